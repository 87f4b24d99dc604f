"""A one-byte KV cache (--kv-cache-dtype fp8*) on the CPU executor beyond the dense single-rank
runner of test_kv_cache_dtype.py: the hybrid models' full-attention layers (greedy tokens and
logprobs teacher-forced against transformers with K and V rounded the same way), speculative
decoding (n-gram, a draft model, an EAGLE head, MTP: output equals speculation off token for
token, fp8 on both sides, the proposer's own cache one-byte too) and tensor parallelism (TP=2
equals TP=1, both greedy under the rounded reference)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, tokenizer
from tests.engine.test_kv_cache_dtype import (
    AMBIGUOUS_ATOL,
    LOGPROB_ATOL,
    check_against,
    rounded_reference,
    run_prompts,
)
from tests.engine.test_spec_eagle import write_head
from tests.engine.test_tensor_parallel import tp_checkpoint
from tests.greedy_reference import check_greedy_tokens, reference_logprobs
from tests.mtp_checkpoints import mtp_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@functools.cache
def reference(path: str, kv_dtype: str):
    return rounded_reference(path, kv_dtype)


def assert_greedy_rounded(path: str, kv_dtype: str, prompt: list[int], got: list[int]) -> None:
    """got greedy under transformers with K and V rounded to kv_dtype, teacher-forced (at
    AMBIGUOUS_ATOL where an element of the reference's K / V sits at a rounding midpoint)."""
    model = reference(path, kv_dtype)
    model.ambiguous = False
    reference_logprobs(model, prompt, got)
    check_greedy_tokens(model, prompt, got, AMBIGUOUS_ATOL if model.ambiguous else LOGPROB_ATOL)


def assert_same_or_tie(
    path: str, kv_dtype: str, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> None:
    """Token for token, except where two runs whose K / V differ in the last fp32 bits (other
    matmul shapes) round an element at a midpoint apart: the streams may then part at a
    near-tie of the rounded reference (both tokens within AMBIGUOUS_ATOL of its best) and are
    not compared past it."""
    model = reference(path, kv_dtype)
    for p, a, b in zip(prompts, got, want, strict=True):
        assert len(a) == len(b) == MAX_NEW, (p, a, b)
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            continue
        lp = reference_logprobs(model, p, b[:k] + [b[k]])[k]
        gaps = (lp.max() - lp[a[k]]).item(), (lp.max() - lp[b[k]]).item()
        assert max(gaps) <= AMBIGUOUS_ATOL, (p, k, a, b, gaps)
        print(f"near-tie at output {k}: {a[k]} vs {b[k]} (gaps {gaps})")


# ---- hybrid models --------------------------------------------------------------------------

# The Gated DeltaNet layers below an attention layer sum in another order than transformers'
# (chunked), so its K / V differ from the reference's by more than a dense model's last fp32
# bits: midpoint elements are looked for within a relative 1e-4.
HYBRID_NUDGE = 1e-4
# Logprobs of the hybrid models against the rounded reference: with every stored code equal to
# the reference's, their fp32 noise still reaches 1.03e-4 at some draws (seed 1072285435: the
# Gated DeltaNet layers' sums in another order than transformers'; 1e-6 to 1e-5 at most). 1e-3
# keeps a 10x margin, and is 10x under what the rounding itself moves (asserted below).
HYBRID_LOGPROB_ATOL = 1e-3


@pytest.mark.parametrize(("arch", "kv_dtype"), [("qwen3_5", "fp8_e5m2"), ("qwen3_next", "fp8")])
def test_hybrid_full_attention_layers(arch: str, kv_dtype: str, rng) -> None:
    """Chunked prefill, mixed and decode-only steps; only the full-attention layers hold a
    (one-byte) cache, each with its KVQuant."""
    path = checkpoint(arch)
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, kv_cache_dtype=kv_dtype))
    assert len(runner.kv_caches) == runner.arch.num_kv_layers < runner.arch.num_layers
    assert all(k.dtype == v.dtype == torch.uint8 for k, v in runner.kv_caches)
    attn = [m.self_attn for m in runner.model.model.layers if m.kind == "full_attention"]
    assert len(attn) == runner.arch.num_kv_layers
    assert all(a.kv_quant is not None and a.kv_quant.workspace is runner.kv_workspace for a in attn)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (rng.randint(2, 6), 37)]
    reqs = run_prompts(runner, prompts, 6, chunk=rng.choice([7, 16, 29]))
    moved = check_against(
        runner, reqs, prompts, path, kv_dtype, 6, nudge=HYBRID_NUDGE, atol=HYBRID_LOGPROB_ATOL
    )
    assert moved > 10 * HYBRID_LOGPROB_ATOL  # the rounding is visible at the tolerance


# ---- speculative decoding -------------------------------------------------------------------


def spec_engine(path, kv_dtype: str, spec=None) -> LLMEngine:
    # An 8-token budget chunks the prompts; 3 sequences at a time (hybrid state slots reused).
    return LLMEngine(
        engine_config(
            model=str(path),
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_dtype,
            speculative_config=spec,
            max_num_batched_tokens=8,
            max_num_seqs=3,
        )
    )


def repetitive_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """A random phrase three times: n-gram lookup finds proposals in them."""
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randrange(3, 7))] * 3 for _ in range(n)]


def _eagle(tmp_path) -> dict:
    head = write_head(tmp_path / "eagle", seed=5)
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


SPEC_CASES = {
    # method: (target, kv dtype, --speculative-config of a tmp_path)
    "ngram": (
        lambda: checkpoint("llama"),
        "fp8_e4m3",
        lambda _: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    ),
    "draft_model": (
        lambda: checkpoint("llama"),
        "fp8_e5m2",
        lambda _: {
            "method": "draft_model",
            "model": str(checkpoint("qwen3")),
            "num_speculative_tokens": 3,
        },
    ),
    "eagle": (lambda: checkpoint("llama"), "fp8", _eagle),
    "mtp": (
        lambda: mtp_checkpoint("qwen3_5"),
        "fp8_e5m2",
        lambda _: {"method": "mtp", "num_speculative_tokens": 3},
    ),
}


@pytest.mark.parametrize("method", sorted(SPEC_CASES))
def test_speculation_equals_spec_off(method: str, rng, tmp_path) -> None:
    """The verify step reads the proposals' K / V back from the one-byte cache as decode reads
    its token's; the proposer's own model (draft, EAGLE head, MTP layers) keeps its cache in
    the target's format."""
    target, kv_dtype, spec = SPEC_CASES[method]
    path = target()
    prompts = repetitive_prompts(rng, 3)
    want = spec_engine(path, kv_dtype).generate(prompts, GREEDY)
    eng = spec_engine(path, kv_dtype, spec(tmp_path))
    if method == "ngram":
        # n-gram lookup proposes only where a generated token recurs, which a tiny random
        # model need not do: its verify steps get the target's own greedy output instead,
        # some tokens corrupted (drafts every step, accepted and rejected).
        ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
        k = eng.proposer.k
        eng.proposer = OracleProposer(k, dict(zip(ids, want)), 0.3, len(tokenizer()), rng.random())
    got = eng.generate(prompts, GREEDY)
    assert eng.stats().spec_decode_num_drafts > 0
    assert eng.check_all_free()
    proposer = eng.runner.proposer
    if method != "ngram":
        assert proposer.kv and all(k.dtype == torch.uint8 for k, _ in proposer.kv)
        fmt = eng.runner.model.model.layers[-1].self_attn.kv_quant.fmt
        layers = getattr(proposer.draft.model, "model", proposer.draft.model).layers
        assert all(layer.self_attn.kv_quant.fmt == fmt for layer in layers)
    assert_same_or_tie(str(path), kv_dtype, prompts, got, want)


# ---- tensor parallelism ---------------------------------------------------------------------


def tp_engine(tp: int) -> LLMEngine:
    return LLMEngine(
        engine_config(
            model=tp_checkpoint("llama"),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            kv_cache_dtype="fp8_e4m3",
            max_num_batched_tokens=16,
            num_kv_blocks=12,
        )
    )


def test_tp2_equals_tp1_and_rounded_transformers(rng) -> None:
    """Two ranks, one KV head each, each rank's cache one-byte: chunked prefill (a 16-token
    budget) and decode."""
    V = 385  # test_tensor_parallel's checkpoint: one row more than the tokenizer
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    e2 = tp_engine(2)
    try:
        assert (
            e2.runner.tp.size == 2 and e2.runner.model.model.layers[0].self_attn.num_kv_heads == 1
        )
        assert all(k.dtype == torch.uint8 for k, _ in e2.runner.kv_caches)
        got = e2.generate(prompts, GREEDY)
    finally:
        e2.runner.shutdown()
    want = tp_engine(1).generate(prompts, GREEDY)
    path = tp_checkpoint("llama")
    assert_same_or_tie(path, "fp8_e4m3", prompts, got, want)
    for p, o in zip(prompts, got, strict=True):
        assert_greedy_rounded(path, "fp8_e4m3", p, o)
