"""The tensor-parallel split arithmetic without processes: which heads, KV heads and vocabulary
rows a rank holds, the narrowing of checkpoint tensors (packed ints and quantization groups kept
whole), and the refusals: sizes the model or the host cannot take."""

from __future__ import annotations

import pytest
import torch
from voltserve.services.executor.models.llama import ModelArch
from voltserve.services.executor.models.qwen3_next import HybridArch
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import TPSplitError, narrow, split_range
from voltserve.services.launcher import gpu_groups

from voltserve.cli import command as voltserve_command


def arch(heads=32, kv=8, inter=14336, vocab=128256) -> ModelArch:
    return ModelArch("LlamaForCausalLM", vocab, 4096, inter, 2, heads, kv, 128, 1e-5, 8192)


def test_split_evenly_and_kv_heads_per_rank():
    lays = [TPLayout.build(arch(), r, 4) for r in range(4)]
    assert [(x.head_start, x.num_heads) for x in lays] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert [(x.kv_head_start, x.num_kv_heads) for x in lays] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [x.inter_start for x in lays] == [0, 3584, 7168, 10752]
    assert all(x.vocab_per_rank * 4 >= 128256 for x in lays)


def test_fewer_kv_heads_than_ranks_replicates_the_one_each_rank_needs():
    # 8 ranks, 2 KV heads (group of 16 query heads each): ranks 0-3 use KV head 0, 4-7 head 1.
    a = arch(heads=32, kv=2)
    lays = [TPLayout.build(a, r, 8) for r in range(8)]
    assert [x.kv_head_start for x in lays] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(x.num_kv_heads == 1 for x in lays)
    for x in lays:  # every query head of the rank belongs to that KV head
        group = a.num_heads // a.num_kv_heads
        assert {h // group for h in range(x.head_start, x.head_start + x.num_heads)} == {
            x.kv_head_start
        }


def test_padded_vocabulary():
    lays = [TPLayout.build(arch(vocab=385), r, 2) for r in range(2)]
    assert [(x.vocab_start, x.vocab_per_rank) for x in lays] == [(0, 193), (193, 193)]
    w = torch.arange(385 * 2, dtype=torch.float32).view(385, 2)
    last = narrow(w, 0, 193, 193, "lm_head.weight")
    assert last.shape == (193, 2)
    assert torch.equal(last[:192], w[193:])
    assert torch.equal(last[192:], torch.zeros(1, 2))


@pytest.mark.parametrize(
    "kw, size, message",
    [
        (dict(heads=32), 64, "larger than the model's 32 attention heads"),
        (dict(heads=32), 3, "num_attention_heads = 32 cannot be split"),
        (dict(heads=24, kv=8), 6, "num_key_value_heads = 8 cannot be split"),
        (dict(heads=24, kv=3), 6, "intermediate_size = 14336 cannot be split"),
        (dict(heads=32, kv=3), 4, "fewer than tensor-parallel size 4 and does not divide it"),
        (dict(heads=16, kv=4, inter=1000), 16, "intermediate_size = 1000 cannot be split"),
    ],
)
def test_impossible_splits_are_refused(kw, size, message):
    with pytest.raises(TPSplitError, match=message):
        TPLayout.build(arch(**kw), 0, size)


def hybrid(key_heads=16, value_heads=48) -> HybridArch:
    """Qwen3.6-27B's shapes (5120 hidden, 24 / 4 attention heads of 256, 17408 MLP)."""
    return HybridArch(
        "Qwen3_5ForCausalLM", 248320, 5120, 17408, 64, 24, 4, 256, 1e-6, 262144,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=128, linear_value_head_dim=128,
    )  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_linear_attention_heads_per_rank(size):
    """Each rank holds Hk / size key heads and the Hv / size value heads that read them (value
    head h reads key head h // (Hv / Hk)); together the ranks hold every head once."""
    a = hybrid()
    rep = a.linear_num_value_heads // a.linear_num_key_heads
    lays = [TPLayout.build(a, r, size) for r in range(size)]
    keys = [h for x in lays for h in range(x.lin_key_start, x.lin_key_start + x.lin_key_heads)]
    values = [
        h for x in lays for h in range(x.lin_value_start, x.lin_value_start + x.lin_value_heads)
    ]
    assert keys == list(range(16)) and values == list(range(48))
    for x in lays:
        read = {h // rep for h in range(x.lin_value_start, x.lin_value_start + x.lin_value_heads)}
        assert read == set(range(x.lin_key_start, x.lin_key_start + x.lin_key_heads))


def test_linear_attention_heads_not_divisible_refused():
    with pytest.raises(TPSplitError, match="linear_num_key_heads = 6 cannot be split"):
        TPLayout.build(hybrid(key_heads=6, value_heads=18), 0, 4)


def test_narrow_keeps_packed_ints_and_groups_whole():
    q = torch.zeros(16, 512, dtype=torch.int32)  # e.g. 4096 int4 columns packed 8 per int32
    assert narrow(q, 1, 2048, 2048, "qweight", pack=8).shape == (16, 256)
    with pytest.raises(TPSplitError, match="cuts a packed int"):
        narrow(q, 1, 4, 2048, "qweight", pack=8)
    with pytest.raises(TPSplitError, match="cuts a quantization group"):
        narrow(q, 1, 64, 2048, "qweight", pack=8, unit=128)
    with pytest.raises(TPSplitError, match="in units of 128"):
        split_range(11008 // 2, 0, 4, "intermediate_size", unit=128)


def test_gpu_groups_per_executor():
    gpus = [str(i) for i in range(8)]
    assert gpu_groups(gpus, 4, 2) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert gpu_groups(gpus, 1, None) == [[g] for g in gpus]
    assert gpu_groups([], 2, None) == []  # CPU: every executor runs its ranks on the CPU
    with pytest.raises(ValueError, match="needs 4 GPUs but 2 are visible"):
        gpu_groups(["0", "1"], 4, None)
    with pytest.raises(ValueError, match="--executors 3 with --tensor-parallel-size 4 needs 12"):
        gpu_groups(gpus, 4, 3)


def test_serve_refuses_more_gpus_than_visible(tmp_path):
    """Before any service starts: -tp 2 with one visible GPU."""
    import os
    import subprocess

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    r = subprocess.run(
        [*voltserve_command(), "serve", "--model", str(tmp_path)]
        + ["--device", "cuda", "--tensor-parallel-size", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "--tensor-parallel-size 2 needs 2 GPUs but 1 are visible" in r.stderr
