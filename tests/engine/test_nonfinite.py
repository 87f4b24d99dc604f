"""Non-finite logits end their own request and nothing else: the sampler flags a row holding NaN
or infinity on the device and samples every other row as it would alone; the engine ends only
that request (finish_reason "error", a 500 naming fp16 overflow), the rest of the batch gets the
tokens it gets without it, the KV blocks it held are zeroed and leave the prefix cache. The
model is tests/overflow_checkpoint.py: finite in fp32, overflowing fp16 on one token."""

from __future__ import annotations

import logging

import pytest
import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.request import NONFINITE, Request
from voltserve.services.executor.sampler import Sampler, SampleRow, finite_rows, flag_nonfinite
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, tokenizer
from tests.overflow_checkpoint import LAYERS, POISON, TRIGGER, overflow_checkpoint

CPU = torch.device("cpu")
V = 257
BAD = (float("nan"), float("inf"), float("-inf"))


def _random_params(rng) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice((0.0, 0.0, 0.7, 1.3)),
        top_k=rng.choice((0, 5)),
        top_p=rng.choice((1.0, 0.8)),
        logprobs=rng.choice((None, 0, 3)),
        repetition_penalty=rng.choice((1.0, 1.3)),
        logit_bias={rng.randrange(V): 2.0} if rng.random() < 0.3 else None,
    )


def _rows(params: list[SamplingParams], seeds: list[int]) -> list[SampleRow]:
    rows = []
    for i, (p, seed) in enumerate(zip(params, seeds)):
        r = Request(f"r{i}", [1, 2, 3 + i], p, seed=seed, arrival_time=0.0)
        rows.append(SampleRow(r, 0))
    return rows


def test_finite_rows_holds_at_the_fp16_extremes_and_finds_one_bad_value(rng) -> None:
    x = torch.full((3, 4096), 65504.0, dtype=torch.float16)
    x[1] = -65504.0
    x[2, rng.randrange(4096)] = rng.choice(BAD)
    assert finite_rows(x).tolist() == [True, True, False]
    ids = flag_nonfinite(torch.tensor([7, 8, 9]), x)
    assert ids.tolist() == [7, 8, NONFINITE]


@pytest.mark.parametrize("greedy_only", [False, True])
def test_sampler_flags_bad_rows_and_samples_the_others_as_alone(rng, greedy_only) -> None:
    n = rng.randint(4, 9)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    x = torch.randn(n, V, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0) if greedy_only else _random_params(rng) for _ in range(n)
    ]
    seeds = [rng.randrange(1 << 62) for _ in range(n)]
    bad = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
    poisoned = x.clone()
    for i in bad:  # one to all of the row's values
        cols = rng.sample(range(V), rng.choice((1, 3, V)))
        poisoned[i, cols] = torch.tensor([rng.choice(BAD) for _ in cols])
    sampler = Sampler(KernelDispatch(CPU), CPU)
    got = sampler(poisoned, _rows(params, seeds))
    good = [i for i in range(n) if i not in bad]
    alone = sampler(x[good].clone(), _rows([params[i] for i in good], [seeds[i] for i in good]))
    assert [got[i].token_id for i in bad] == [NONFINITE] * len(bad)
    for i, want in zip(good, alone):
        assert got[i].token_id == want.token_id
        assert got[i].logprob == pytest.approx(want.logprob, abs=1e-5) or want.logprob is None
    for i in bad:
        assert got[i].logprob is None and not got[i].top_logprobs


def _run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in reqs}
    logprobs: dict[str, list[float]] = {rid: [] for rid in reqs}
    ends = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [t.logprob for t in o.new_logprobs or ()]
            if o.finished:
                ends[o.request_id] = o
    return tokens, logprobs, ends


def _engine(dtype: str, layer: int = 0, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(overflow_checkpoint(layer)), dtype=dtype, num_kv_blocks=64, **kw)
    return LLMEngine(cfg)


def _prompt(rng, n: int, poison_at: int | None = None) -> list[int]:
    plain = [t for t in range(3, len(tokenizer())) if t not in (POISON, TRIGGER)]
    ids = [rng.choice(plain) for _ in range(n)]
    if poison_at is not None:
        ids[poison_at] = POISON
    return ids


def _params(rng, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice((0.0, 0.8)),
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=rng.randrange(1 << 30),
        **kw,
    )


def test_engine_ends_only_the_poisoned_requests(rng) -> None:
    """One batch: poisoned prompts (POISON anywhere, alone, with logprobs) beside clean ones;
    then the poisoned prompt again (its full blocks were cached: the rerun must not hit them)."""
    clean = {f"ok{i}": (_prompt(rng, rng.randint(1, 40)), _params(rng)) for i in range(3)}
    clean["ok-lp"] = (_prompt(rng, 20), _params(rng, logprobs=2))
    n = rng.randint(17, 40)
    poisoned = {
        "bad-mid": (_prompt(rng, n, rng.randrange(n)), _params(rng)),
        "bad-alone": ([POISON], _params(rng)),
        "bad-lp": (_prompt(rng, 20, 19), _params(rng, logprobs=3)),
    }
    engine = _engine("float16")
    tokens, logprobs, ends = _run(engine, {**clean, **poisoned})
    want_tokens, want_lp, want_ends = _run(_engine("float16"), clean)
    for rid in clean:
        assert POISON not in want_tokens[rid]  # the checkpoint never generates it
        assert tokens[rid] == want_tokens[rid] and want_ends[rid].finish_reason == "length"
        assert logprobs[rid] == pytest.approx(want_lp[rid], abs=1e-4)
    for rid in poisoned:
        o = ends[rid]
        assert tokens[rid] == [] and o.finish_reason == "error"
        assert o.error_status == 500 and o.error_type == "internal_server_error"
        assert "non-finite" in o.error and "float16" in o.error and "--dtype float32" in o.error
    assert engine.stats().nonfinite_requests_total == len(poisoned)
    assert engine.check_all_free()
    # No NaN waits in a free block, and no cached block holds a poisoned prefix.
    assert all(
        torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in engine.runner.kv_caches
    )
    again = {"bad-again": poisoned["bad-mid"]}
    _, _, ends = _run(engine, again)
    assert ends["bad-again"].finish_reason == "error"
    assert engine.stats().nonfinite_requests_total == len(poisoned) + 1


def test_float32_serves_the_prompts_that_overflow_float16(rng) -> None:
    """The README's advice: --dtype float32 answers them (as transformers does in fp32)."""
    from tests.greedy_reference import check_greedy_outputs, reference_model

    prompt = _prompt(rng, rng.randint(2, 20), 0)
    tokens, _, ends = _run(
        _engine("float32"),
        {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))},
    )
    assert ends["r"].finish_reason == "length"
    model = reference_model(str(overflow_checkpoint()))
    check_greedy_outputs(model, [prompt], [tokens["r"]], 5)


def test_a_nonfinite_prompt_logprobs_row_ends_the_request(rng) -> None:
    """Overflowing in the last layer, only POISON's own row is NaN: a request without prompt
    logprobs is unaffected (its sampled row is finite), one with them gets the error rather
    than a NaN logprob."""
    prompt = _prompt(rng, rng.randint(4, 30))
    prompt[rng.randrange(len(prompt) - 1)] = POISON  # not the last token
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    reqs = {
        "plain": (prompt, params),
        "plp": (prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)),
    }
    engine = _engine("float16", layer=LAYERS - 1, enable_prefix_caching=False)
    tokens, _, ends = _run(engine, reqs)
    assert ends["plain"].finish_reason == "length" and len(tokens["plain"]) == 4
    assert ends["plp"].finish_reason == "error" and tokens["plp"] == []
    assert engine.stats().nonfinite_requests_total == 1


def test_layer_trace_names_the_layer_that_overflows(rng, monkeypatch, caplog) -> None:
    monkeypatch.setenv("VOLTSERVE_LAYER_TRACE", "1")
    layer = rng.randrange(LAYERS)
    engine = _engine("float16", layer=layer)
    with caplog.at_level(logging.WARNING, logger="voltserve.services.executor.layer_trace"):
        _run(engine, {"r": (_prompt(rng, 6, rng.randrange(6)), SamplingParams(max_tokens=2))})
    traced = [r.getMessage() for r in caplog.records if "layer trace:" in r.getMessage()]
    assert traced and f"the output of layer {layer} of {LAYERS}" in traced[0], traced
    assert "float16 holds up to 65504" in traced[0]


# ---- the graph and pipeline path, and speculation: NaN injected into a request's KV ---------


def _poison_kv(runner, req: Request) -> None:
    """NaN in every slot of the request's blocks in layer 0: its next row reads them."""
    idx = torch.tensor(req.block_ids)
    for k, v in runner.kv_caches[:1]:
        k[idx] = float("nan")
        v[idx] = float("nan")


def _run_poisoning(engine: LLMEngine, reqs, victim: str, at_step: int):
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in reqs}
    ends = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == at_step:
            _poison_kv(engine.runner, engine.requests[victim])
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                ends[o.request_id] = o.finish_reason
        step += 1
    return tokens, ends


def test_graph_decode_and_the_pipeline_flag_a_row_and_go_on(rng, monkeypatch) -> None:
    """The CPU emulation of the decode graphs (the flag is computed inside the graph body) with
    the pipelined decode on: the poisoned row's NONFINITE id is fed to the step launched ahead
    (clamped), the request ends, the launched step is used without it. The decode attention is
    the reference, which reads a sequence's own positions only, as the numba kernel does (the
    torch fallback weights every slot of the table's width, padding entries naming block 0
    included, so NaN in block 0 would reach every row of that step)."""
    from voltserve.kernels.attention.ref import paged_decode_attention_ref
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    from tests.engine.test_graph_padding import _emulated_graph_runner

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    cfg = EngineConfig(model=str(checkpoint("llama")), max_model_len=128, num_kv_blocks=32)
    runner = _emulated_graph_runner(cfg, 4)
    runner.ops.paged_decode_attention = paged_decode_attention_ref
    runner.pipeline = DecodePipeline(runner, max_batch=4)
    V = len(tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = {
        f"r{i}": ([rng.randrange(V) for _ in range(rng.randint(1, 16))], greedy) for i in range(3)
    }
    victim = f"r{rng.randrange(3)}"
    at = rng.randint(3, 8)
    tokens, ends = _run_poisoning(LLMEngine(cfg, runner), reqs, victim, at)
    want, _ = _run_poisoning(LLMEngine(cfg), reqs, victim, -1)
    assert ends[victim] == "error" and tokens[victim] == want[victim][: len(tokens[victim])]
    assert len(tokens[victim]) >= at - 1
    for rid in set(reqs) - {victim}:
        assert ends[rid] == "length" and tokens[rid] == want[rid]
    assert runner.graphs.num_replays > 0 and runner.pipeline.used > 0


def test_speculative_verify_rows_flag_a_request(rng) -> None:
    """The target as its own draft model: every decode step after the first token verifies
    proposals; a poisoned request's verify rows end it, the others go on."""
    model = str(checkpoint("llama"))
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    cfg = engine_config(model=model, max_model_len=128, num_kv_blocks=48, speculative_config=spec)
    V = len(tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = {
        f"r{i}": ([rng.randrange(V) for _ in range(rng.randint(1, 20))], greedy) for i in range(3)
    }
    victim = f"r{rng.randrange(3)}"
    engine = LLMEngine(cfg)
    tokens, ends = _run_poisoning(engine, reqs, victim, 2)
    want, _ = _run_poisoning(LLMEngine(cfg), reqs, victim, -1)
    assert ends[victim] == "error" and engine.stats().spec_decode_num_drafts > 0
    for rid in set(reqs) - {victim}:
        assert ends[rid] == "length" and tokens[rid] == want[rid]
    assert engine.stats().nonfinite_requests_total == 1
