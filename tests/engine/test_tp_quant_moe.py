"""Tensor parallelism (gloo, 2 ranks as separate processes, fp32 on the CPU) for quantized, GGUF
and mixture-of-experts checkpoints: greedy outputs of a TP=2 engine equal a TP=1 engine token
for token and are greedy under transformers (teacher-forced: tests/greedy_reference.py), with
chunked prefill and a batch.

Checkpoints come from the writers of the quantization and MoE tests (tests/quant_checkpoints.py
from each format's packing rules, tests/checkpoints.py with transformers); the transformers
reference is independent of our loader (the dequantized float checkpoint, or the .gguf file read
by transformers). Each case checks that the rank really holds a shard. Refusals of layouts that
cannot be split name the tensor and the sizes."""

from __future__ import annotations

import functools

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.services.executor.tp.group import TPGroup
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests import quant_checkpoints as qc
from tests.checkpoints import checkpoint, tokenizer
from tests.greedy_reference import TOKEN_ATOL, check_greedy_tokens

CPU = torch.device("cpu")


# case -> (checkpoint, transformers reference folder, gguf file name or None). The same
# checkpoints as the single-GPU quantization and MoE tests (their writers cache them).
CASES = {
    "awq-g128-llama": lambda: (*qc.awq_checkpoint("llama", 128), None),
    # act-order: each row-parallel rank's columns belong to any groups
    "gptq-4b-act-qwen2": lambda: (
        *qc.gptq_checkpoint("qwen2", 4, 64, desc_act=True, sym=True),
        None,
    ),
    "gptq-4b-noact-asym-qwen3": lambda: (
        *qc.gptq_checkpoint("qwen3", 4, 128, desc_act=False, sym=False, v1=False),
        None,
    ),
    # 8-bit zero points packed along the outputs; per-channel scales on a row-parallel rank
    "ct-w8a16-channel-asym-qwen2": lambda: (*qc.ct_checkpoint("qwen2", 8, None, sym=False), None),
    # Q4_K / Q6_K rows and whole 256-element blocks per row-parallel rank, a Q5_0 up beside a
    # Q4_K gate, an F16 k beside quantized q / v, a Q6_K lm_head split by vocabulary rows
    "gguf-q4_k_m-qwen3": lambda: (
        (d := qc.gguf_checkpoint("qwen3", qc.q4_k_m_types, "Q4_K_M")) / "model.gguf",
        d,
        "model.gguf",
    ),
    "qwen3_moe": lambda: (checkpoint("qwen3_moe"), checkpoint("qwen3_moe"), None),
    # a shared expert (split like a dense MLP) beside the routed ones
    "qwen2_moe": lambda: (checkpoint("qwen2_moe"), checkpoint("qwen2_moe"), None),
    "mixtral": lambda: (checkpoint("mixtral"), checkpoint("mixtral"), None),
    # group-quantized experts, each one's intermediate dim split
    "awq-g32-qwen3_moe": lambda: (*qc.awq_checkpoint("qwen3_moe", 32), None),
    # GGUF stacked experts cut per expert on whole Q8_0 blocks (the tiny K-quant file's 256-wide
    # blocks span a whole row-parallel input: refused, as the block-cut test shows)
    "gguf-q8_0-qwen3_moe": lambda: (
        (d := qc.gguf_checkpoint("qwen3_moe-gguf", _q8_0, "qwen3moe-Q8_0")) / "model.gguf",
        d,
        "model.gguf",
    ),
}


def _q8_0(_gguf_name: str) -> str:
    return "Q8_0"


# transformers' GGUF loader builds MoE configs from its defaults, not the file's expert sizes
# (tests/engine/test_gguf_moe.py): it loads these files into the float checkpoint's config.
HF_CONFIG = {"gguf-q8_0-qwen3_moe": lambda: qc.float_checkpoint("qwen3_moe-gguf")}


@functools.cache
def case(name: str):
    return CASES[name]()


def engine(path, tp: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            max_num_batched_tokens=16,
            num_kv_blocks=16,
            max_num_seqs=4,
        )
    )


def assert_reference_greedy(name: str, prompt: list[int], got: list[int], n: int) -> None:
    """got: n greedy tokens under transformers, teacher-forced (tests/greedy_reference.py: a
    tie may go either way)."""
    _, ref, gguf = case(name)
    config = HF_CONFIG[name]() if name in HF_CONFIG else None
    model = _hf_model(str(ref), gguf, None if config is None else str(config))
    assert len(got) == n, (name, prompt, got)
    check_greedy_tokens(model, prompt, got, TOKEN_ATOL)


@functools.cache
def _hf_model(ref: str, gguf: str | None, config: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {} if gguf is None else {"gguf_file": gguf}
    if config is not None:
        kw["config"] = AutoConfig.from_pretrained(config)
    return AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, **kw).eval()


def _check_sharded(name: str, model) -> None:
    """The rank holds half of what the whole model holds (so the test cannot pass unsharded)."""
    a = model.arch
    layer = (
        model.model.layers[next(i for i in range(a.num_layers) if a.is_moe_layer(i))]
        if a.num_experts
        else model.model.layers[0]
    )
    attn = layer.self_attn
    assert attn.num_heads == a.num_heads // 2
    assert attn.o_proj.in_features == a.num_heads * a.head_dim // 2
    if a.num_experts:
        moe = layer.mlp
        assert moe.experts.inter == a.moe_intermediate_size // 2
        if moe.shared_expert is not None:
            sh = moe.shared_expert.down_proj
            assert sh.in_features == a.shared_expert_intermediate_size // 2
        return
    down = layer.mlp.down_proj
    assert down.in_features == a.intermediate_size // 2
    if name.startswith(("awq", "gptq-4b-noact", "ct", "gguf")):
        # quantized on the rank: codes of its own columns only
        assert down.qweight is not None and down.qweight.in_features == down.in_features
        assert layer.mlp.gate_up_proj.qweight.out_features == a.intermediate_size


# ---- refusals: layouts a tensor-parallel size cannot split ----------------------------------


def test_gguf_block_cut_by_a_row_parallel_shard_is_refused_by_name():
    """Q4_K blocks hold 256 inputs; llama's o_proj has 256 inputs, 128 per rank at TP=2: the
    engine refuses at load naming the tensor, and the other rank is stopped (no stray exit)."""
    d = qc.gguf_checkpoint("llama", qc.q4_k_m_types, "Q4_K_M")
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight.*slice \[0, 128\).*block"):
        engine(d / "model.gguf", 2)


def test_quantization_groups_not_divisible_by_the_ranks_are_refused_by_name():
    """AWQ group 256 on down_proj (512 inputs: 2 groups) cannot be split across 4 ranks; the
    message names the tensor, the slice and the group (checked on the loading path of one rank:
    loading runs no collective)."""
    path, _ = qc.awq_checkpoint("llama", 256)
    with pytest.raises(
        ModelLoadError, match=r"down_proj.*\[0, 128\) of K=512 cuts a quantization group of 256"
    ):
        load_model(path, torch.float32, CPU, tp=TPGroup(0, 4, CPU))


def test_per_channel_and_whole_group_shards_load_on_every_rank():
    """The same AWQ group 256 splits across 2 ranks (whole groups; o_proj's one group per row
    serves each rank's columns), and every rank's shards dequantize to its slice of the whole
    weight."""
    from voltserve.kernels.linear.quant_pack import dequantize

    path, _ = qc.awq_checkpoint("llama", 256)
    full = load_model(path, torch.float32, CPU).model.model.layers[0]
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        whole = dequantize(full.get_submodule(name).qweight)
        parts = [
            load_model(path, torch.float32, CPU, tp=TPGroup(r, 2, CPU))
            .model.model.layers[0]
            .get_submodule(name)
            for r in range(2)
        ]
        assert torch.equal(torch.cat([dequantize(p.qweight) for p in parts], 1), whole), name


# ---- TP=2 against TP=1 and transformers (one test per case: each pair of engines is torn down
# after it, as a process holds one process group at a time) -----------------------------------


@pytest.fixture(params=sorted(CASES))
def engines(request):
    name = request.param
    path, _, _ = case(name)
    e1, e2 = engine(path, 1), engine(path, 2)
    yield name, e1, e2
    e2.runner.shutdown()


def test_tp2_equals_tp1_and_transformers(engines, rng):
    """Two prompts (one longer than the 16-token step budget: chunked prefill) in one batch."""
    name, e1, e2 = engines
    assert e2.runner.tp is not None and e2.runner.tp.size == 2
    _check_sharded(name, e2.runner.model)
    V = len(tokenizer())
    prompts = [
        [rng.randrange(V) for _ in range(n)] for n in (rng.randint(2, 6), rng.randint(17, 22))
    ]
    n = 4
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _ in prompts]
    out2 = e2.generate(prompts, params)
    out1 = e1.generate(prompts, params)
    for p, o1, o2 in zip(prompts, out1, out2):
        assert o2 == o1, (name, p)
        assert_reference_greedy(name, p, o1, n)
    assert e2.check_all_free()
