"""GGUF mixture-of-experts files (qwen3moe, qwen2moe) through the model runner against
transformers loading the same .gguf file (`gguf_file=`; fp32, CPU).

The files are written by tests/quant_checkpoints.py as llama.cpp's converter lays them out:
each layer's routed experts stacked per projection (blk.N.ffn_gate_exps / ffn_up_exps /
ffn_down_exps), the router ffn_gate_inp, Qwen2-MoE's shared expert (ffn_*_shexp) and its gate
vector ffn_gate_inp_shexp; quantized with the gguf package (Q8_0, Q5_0) or from the K-quant
block layouts (Q4_K, Q6_K), or float (F16). Two prompts run batched through chunked prefill;
greedy tokens equal, logprobs of the chosen tokens within LOGPROB_ATOL (test_quant_models).
Mixtral (a llama-architecture file with experts), which transformers cannot load from GGUF,
is refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.services.executor.models.moe import UnquantizedExperts
from voltserve.services.executor.quant.experts import GroupQuantExperts

from tests import quant_checkpoints as qc
from tests.engine.test_quant_models import _seed, check_against_reference

CPU = torch.device("cpu")


def qwen3_k_mix(gname: str) -> str:
    """A Q4_K_M-style MoE mix: Q4_K attention and gate/up experts, Q6_K down experts and
    output head (a layer's w13 and w2 of different ggml types), one layer's router quantized
    (Q8_0: dequantized on load, the router stays float), the other F32 as llama.cpp keeps it."""
    if gname == "output.weight" or gname.endswith("ffn_down_exps.weight"):
        return "Q6_K"
    if gname == "blk.0.ffn_gate_inp.weight":
        return "Q8_0"
    if gname.endswith("ffn_gate_inp.weight"):
        return "F32"
    return "Q4_K"


def qwen2_mix(gname: str) -> str:
    """Qwen2-MoE: gate experts Q4_K beside Q8_0 up experts (one w13 of two types) and Q5_0
    down experts (the expert intermediate, 96, takes 32-element types only); the shared expert
    Q4_K with a Q6_K down projection, Q8_0 attention, F32 routers."""
    if gname.endswith("ffn_down_exps.weight"):
        return "Q5_0"
    if gname.endswith("ffn_up_exps.weight"):
        return "Q8_0"
    if gname.endswith("ffn_down_shexp.weight"):
        return "Q6_K"
    if gname.endswith(("ffn_gate_exps.weight", "_shexp.weight")):
        return "Q4_K"
    if gname.endswith("ffn_gate_inp.weight"):
        return "F32"
    return "Q8_0"


CASES = {
    "qwen3moe-Kmix": ("qwen3_moe-gguf", qwen3_k_mix),
    "qwen3moe-F16": ("qwen3_moe-gguf", lambda _n: "F16"),
    "qwen2moe-mix": ("qwen2_moe-gguf", qwen2_mix),
}


@pytest.mark.parametrize("case", CASES)
def test_gguf_moe_matches_transformers(case: str) -> None:
    from transformers import AutoConfig

    arch, types = CASES[case]
    d = qc.gguf_checkpoint(arch, types, case)
    # transformers' GGUF loader takes no expert sizes from the metadata (it would build its
    # config classes' defaults, 768 / 1408 + 5632): it loads the file's tensors into the float
    # checkpoint's config. What it does read is checked against ours in the next test.
    hf_cfg = AutoConfig.from_pretrained(qc.float_checkpoint(arch))
    runner = check_against_reference(d / "model.gguf", d, gguf=True, seed=_seed(), config=hf_cfg)
    cfg = json.loads((qc.float_checkpoint(arch) / "config.json").read_text())
    a = runner.arch
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (
        4,
        2,
        cfg["moe_intermediate_size"],
    )
    assert a.shared_expert_intermediate_size == cfg.get("shared_expert_intermediate_size", 0)
    for layer in runner.model.model.layers:
        moe = layer.mlp
        assert type(moe).__name__ == "SparseMoE"
        assert type(moe.gate.method).__name__ == "UnquantizedMethod"
        want = UnquantizedExperts if case.endswith("F16") else GroupQuantExperts
        assert isinstance(moe.experts.method, want)
    if case == "qwen3moe-Kmix":
        fe = runner.model.model.layers[0].mlp.experts
        assert fe.method.describe() == "GGUF Q4_K/GGUF Q6_K experts"
        w13, w2 = fe.quant_weights["w13"][0], fe.quant_weights["w2"][0]
        assert (w13.bits, w13.group_size, w2.bits, w2.group_size) == (4, 32, 8, 16)
    if case == "qwen2moe-mix":
        fe = runner.model.model.layers[1].mlp.experts
        w13, w2 = fe.quant_weights["w13"][0], fe.quant_weights["w2"][0]
        assert (w13.bits, w2.bits) == (8, 8)  # Q4_K gate widened beside the Q8_0 up
        shared = runner.model.model.layers[1].mlp.shared_expert
        assert shared.down_proj.qweight is not None


@pytest.mark.parametrize("arch", ["qwen3_moe-gguf", "qwen2_moe-gguf"])
def test_config_agrees_with_what_transformers_reads_from_the_metadata(arch: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from voltserve.services.executor.gguf_source import GGUFSource

    d = qc.gguf_checkpoint(arch, lambda _n: "Q8_0", "Q8_0")
    theirs = load_gguf_checkpoint(str(d / "model.gguf"))["config"]
    ours = GGUFSource(d).config
    assert ours["model_type"] == theirs["model_type"]
    keys = ["num_experts", "num_experts_per_tok", "hidden_size", "num_hidden_layers"]
    keys += ["num_attention_heads", "num_key_value_heads", "norm_topk_prob", "vocab_size"]
    for k in keys:
        # norm_topk_prob: a GGUF default transformers sets for qwen3_moe, else its class's
        default = {"norm_topk_prob": False}.get(k)
        assert ours[k] == theirs.get(k, default), k
    want = json.loads((qc.float_checkpoint(arch) / "config.json").read_text())
    for k in ("moe_intermediate_size", "shared_expert_intermediate_size", "head_dim"):
        if k in want:
            assert ours[k] == want[k], k


def test_expert_sizes_come_from_the_tensors_when_the_metadata_lacks_them() -> None:
    """llama.cpp writes expert_(shared_)feed_forward_length; a file without them still loads,
    its sizes read from the stacked tensors' shapes."""
    d = qc.gguf_checkpoint("qwen2_moe-gguf", lambda _n: "Q8_0", "Q8_0-nosizes", expert_sizes=False)
    a = load_model(d / "model.gguf", torch.float32, CPU).arch
    assert (a.moe_intermediate_size, a.shared_expert_intermediate_size) == (96, 256)


_META = {
    "block_count": 1,
    "embedding_length": 32,
    "feed_forward_length": 64,
    "attention.head_count": 2,
    "context_length": 64,
}


def test_mixtral_gguf_is_refused_by_name(tmp_path) -> None:
    """Mixtral: llama.cpp writes a llama-architecture file with expert_count and stacked
    experts. With the metadata key, and with only the tensors."""
    exps = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 64, 32), np.float32)}
    qc.small_gguf(
        tmp_path / "a.gguf", "llama", {**_META, "expert_count": 4, "expert_used_count": 2}, exps
    )
    with pytest.raises(ModelLoadError, match=r"llama.expert_count 4 \(Mixtral\) is not supported"):
        load_model(tmp_path / "a.gguf", torch.float32, CPU)
    qc.small_gguf(tmp_path / "b.gguf", "llama", _META, exps)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_exps\.weight'.*Mixtral"):
        load_model(tmp_path / "b.gguf", torch.float32, CPU)


def test_moe_gguf_with_a_wrong_expert_count_is_refused_naming_the_tensor(tmp_path) -> None:
    meta = {**_META, "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 64}
    tensors = {
        "blk.0.ffn_gate_inp.weight": np.zeros((4, 32), np.float32),
        "blk.0.ffn_gate_exps.weight": np.zeros((3, 64, 32), np.float32),
        "blk.0.ffn_up_exps.weight": np.zeros((4, 64, 32), np.float32),
        "blk.0.ffn_down_exps.weight": np.zeros((4, 32, 64), np.float32),
    }
    qc.small_gguf(tmp_path / "m.gguf", "qwen3moe", meta, tensors)
    with pytest.raises(
        ModelLoadError, match=r"'blk\.0\.ffn_gate_exps\.weight': shape \[3, 64, 32\]"
    ):
        load_model(tmp_path / "m.gguf", torch.float32, CPU)
    del tensors["blk.0.ffn_gate_exps.weight"]
    qc.small_gguf(tmp_path / "n.gguf", "qwen3moe", meta, tensors)
    with pytest.raises(ModelLoadError, match=r"lacks tensor 'blk\.0\.ffn_gate_exps\.weight'"):
        load_model(tmp_path / "n.gguf", torch.float32, CPU)


def test_other_moe_architectures_stay_refused_by_name(tmp_path) -> None:
    qc.small_gguf(tmp_path / "d.gguf", "deepseek2", _META, {})
    with pytest.raises(ModelLoadError, match=r"architecture 'deepseek2' is not supported"):
        load_model(tmp_path / "d.gguf", torch.float32, CPU)
