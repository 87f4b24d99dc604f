"""Tensor parallelism for the hybrid linear-attention models on the CPU (gloo, 2 ranks, fp32):
greedy outputs of a TP=2 engine equal transformers token for token (teacher-forced) for Qwen3.5 (dense, the
four separate Gated DeltaNet projections, in_proj_qkv split per head) and Qwen3-Next (MoE with
a shared expert, the fused per-key-head in_proj_qkvz / in_proj_ba, tied embeddings), with
chunked prefill and more requests than state slots (each slot is reused); the AWQ Qwen3.5
checkpoint of test_hybrid_quant.py (the int4 shards narrowed per rank); and the refusal of a
linear-attention head count the size cannot split."""

from __future__ import annotations

import functools

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.tp.sharding import TPSplitError
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, hf_model_class, tokenizer
from tests.engine.test_hybrid_quant import CASES as QUANT_CASES
from tests.greedy_reference import TOKEN_ATOL, check_greedy_tokens

SLOTS = 3  # max_num_seqs: fewer than the requests, so finished requests' slots are reused


@functools.cache
def paths(case: str) -> tuple[str, str]:
    """(the checkpoint served, the float checkpoint transformers runs as the reference)."""
    if case in QUANT_CASES:
        path, ref = QUANT_CASES[case]()
        return str(path), str(ref)
    return str(checkpoint(case)), str(checkpoint(case))


@functools.cache
def hf_model(case: str):
    ref = paths(case)[1]
    return hf_model_class(ref).from_pretrained(ref, dtype=torch.float32).eval()


def engine(case: str, tp: int) -> LLMEngine:
    return LLMEngine(
        engine_config(
            model=paths(case)[0],
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            max_num_batched_tokens=8,
            max_num_seqs=SLOTS,
        )
    )


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "awq-qwen3_5"])
def test_tp2_hybrid_equals_transformers(arch: str, rng) -> None:
    """Five prompts of 9-20 tokens through an 8-token budget (every prompt is chunked, a later
    chunk continuing from the state its slot holds) and 3 state slots: two requests wait for
    a slot and start on one another request left."""
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(9, 20))] for _ in range(5)]
    n = [rng.randint(3, 6) for _ in prompts]
    e = engine(arch, 2)
    try:
        r = e.runner
        assert r.tp is not None and r.tp.size == 2
        model = r.model
        gdn = next(m.linear_attn for m in model.model.layers if m.kind == "linear_attention")
        a = model.arch
        # Each rank holds half the linear-attention heads, and its state only for them.
        assert (gdn.hk, gdn.hv) == (a.linear_num_key_heads // 2, a.linear_num_value_heads // 2)
        conv_pool, rec_pool = r.state_cache.layers[0]
        assert tuple(rec_pool.shape) == (SLOTS, gdn.hv, gdn.dk, gdn.dv)
        assert conv_pool.shape[:2] == (SLOTS, gdn.conv_dim)
        assert gdn.conv_dim == a.conv_dim // 2
        params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in n]
        assert len(prompts) > SLOTS
        outs = e.generate(prompts, params)
        assert [len(o) for o in outs] == n
        for p, got in zip(prompts, outs):
            check_greedy_tokens(hf_model(arch), p, got, TOKEN_ATOL)
        assert e.check_all_free()
    finally:
        e.runner.shutdown()


def test_tp_not_dividing_linear_heads_refused() -> None:
    """The tiny Qwen3.5 has 2 key heads: 4 ranks cannot split them (its 4 attention heads, 2
    KV heads and MLP could be); refused by name before any rank starts."""
    with pytest.raises(TPSplitError, match="linear_num_key_heads = 2 cannot be split"):
        engine("qwen3_5", 4)
