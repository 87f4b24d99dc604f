"""Edge cases of the engine and the sampler, with vLLM's semantics where the contract is silent:
length limits at the context edge, min_tokens against eos and stop ids, logprobs, extreme
truncation settings, penalties (also across a failover resume), logit bias, aborts, request id
reuse, shared and identical prompts, preemption of prefix-cache hits, and a KV pool that holds
exactly one request. Real tiny checkpoints on the CPU, short outputs."""

from __future__ import annotations

import functools
import random
from collections import defaultdict

import pytest
import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.request import Request
from voltserve.services.executor.sampler import Sampler, SampleRow
from voltserve.shared.sampling_params import SamplingParams

from tests.engine.test_engine_e2e import (
    VOCAB,
    assert_all_free,
    assert_greedy,
    greedy,
    hf_model,
    make_engine,
    rand_prompt,
)

ARCH = "qwen2"


def run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]], **add_kw):
    """Add the requests, step to the end; (tokens, finish reasons, logprobs) per request id,
    also of requests added before the call."""
    for rid, (prompt, p) in reqs.items():
        engine.add_request(rid, prompt, p, **add_kw)
    tokens = defaultdict(list, {rid: [] for rid in reqs})
    finish: dict[str, str] = {}
    logprobs = defaultdict(list, {rid: [] for rid in reqs})
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finish, "output after the finish"
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs or []
            if out.finished:
                finish[out.request_id] = out.finish_reason
        steps += 1
        assert steps < 5000
    return tokens, finish, logprobs


@functools.cache
def engine_eos() -> int:
    return make_engine(ARCH).eos_token_ids[0]


def other_token(avoid) -> int:
    return next(t for t in range(3, VOCAB) if t not in avoid)


# ---- lengths -----------------------------------------------------------------------------------


def test_max_tokens_one_and_min_equals_max(rng):
    engine = make_engine(ARCH)
    eos = engine_eos()
    prompt = rand_prompt(rng, 1, 30)
    toks, fin, _ = run(engine, {"a": (prompt, greedy(1, ignore_eos=False))})
    assert_greedy(ARCH, prompt, toks["a"], 1, False)
    assert fin["a"] in ("length", "stop")
    # eos pushed to the top: min_tokens == max_tokens holds it back for every position, so the
    # request always runs the full length and never emits an eos.
    for n in (1, 5):
        p = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, logit_bias={eos: 100.0})
        toks, fin, _ = run(engine, {"b": (prompt, p)})
        assert len(toks["b"]) == n and fin["b"] == "length"
        assert not set(toks["b"]) & set(engine.eos_token_ids)
    assert_all_free(engine)


def test_context_edge_finishes_with_length(rng):
    engine = make_engine(ARCH, max_model_len=64)
    assert engine.max_model_len == 64
    # prompt of max_model_len - 1: exactly one token, finish "length"
    prompt = rand_prompt(rng, 63, 63)
    toks, fin, _ = run(engine, {"edge": (prompt, greedy(50))})
    assert_greedy(ARCH, prompt, toks["edge"], 1, True)
    assert fin["edge"] == "length"
    # a prompt of max_model_len leaves no room: rejected loudly
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("full", rand_prompt(rng, 64, 64), greedy(1))
    # generation runs into max_model_len before max_tokens
    prompt = rand_prompt(rng, 40, 55)
    toks, fin, _ = run(engine, {"grow": (prompt, greedy(100))})
    assert len(prompt) + len(toks["grow"]) == 64 and fin["grow"] == "length"
    assert_greedy(ARCH, prompt, toks["grow"], 64 - len(prompt), True)
    assert_all_free(engine)


# ---- stop rules --------------------------------------------------------------------------------


def test_eos_exactly_at_min_tokens(rng):
    engine = make_engine(ARCH)
    eos = engine_eos()
    prompt = rand_prompt(rng, 1, 20)
    # eos forced everywhere: banned at output positions 0..min_tokens-1, emitted right after
    for m in (0, 1, 3):
        p = SamplingParams(max_tokens=10, min_tokens=m, temperature=0.0, logit_bias={eos: 100.0})
        toks, fin, _ = run(engine, {"r": (prompt, p)})
        assert len(toks["r"]) == m + 1 and toks["r"][-1] == eos and fin["r"] == "stop", m
        assert eos not in toks["r"][:-1]
    assert_all_free(engine)


def test_stop_token_ids_and_ignore_eos(rng):
    engine = make_engine(ARCH)
    eos = engine_eos()
    x = other_token(engine.eos_token_ids)
    prompt = rand_prompt(rng, 1, 20)
    biased = dict(max_tokens=6, temperature=0.0, logit_bias={eos: 100.0})
    cases = {
        # eos listed among the stop ids: one stop, as with eos alone
        "eos_in_stop": (SamplingParams(stop_token_ids=[eos, x], **biased), [eos], "stop"),
        # ignore_eos: eos is an ordinary token ...
        "ignore": (SamplingParams(ignore_eos=True, **biased), [eos] * 6, "length"),
        # ... but an explicit stop id still stops, even when it is the eos id (vLLM does too)
        "ignore_but_stop": (
            SamplingParams(ignore_eos=True, stop_token_ids=[eos], **biased),
            [eos],
            "stop",
        ),
        "ignore_other_stop": (
            SamplingParams(
                max_tokens=6,
                temperature=0.0,
                ignore_eos=True,
                stop_token_ids=[x],
                logit_bias={eos: 50.0, x: 100.0},
                min_tokens=2,
            ),
            [eos, eos, x],  # x held back by min_tokens (eos is not: it stops nothing)
            "stop",
        ),
    }
    toks, fin, _ = run(engine, {k: (prompt, c[0]) for k, c in cases.items()})
    for k, (_, want, reason) in cases.items():
        assert (toks[k], fin[k]) == (want, reason), k
    assert_all_free(engine)


# ---- logprobs ----------------------------------------------------------------------------------


def raw_logprobs(prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits for each generated position [len(out), V]."""
    with torch.no_grad():
        ids = torch.tensor([prompt + out])
        logits = hf_model(ARCH)(ids).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1]
    return torch.log_softmax(logits.float(), -1)


def test_logprobs_zero_and_twenty(rng):
    engine = make_engine(ARCH)
    prompt = rand_prompt(rng, 1, 30)
    reqs = {
        "lp0": (prompt, SamplingParams(max_tokens=4, temperature=0.8, seed=7, logprobs=0)),
        "lp20": (prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=20)),
        "none": (prompt, SamplingParams(max_tokens=4, temperature=0.0)),
    }
    for p in (r[1] for r in reqs.values()):
        p.ignore_eos = True
    toks, _, lps = run(engine, reqs)
    assert lps["none"] == [] and toks["none"] == toks["lp20"]
    for rid, n in (("lp0", 0), ("lp20", 20)):
        ref = raw_logprobs(prompt, toks[rid])
        assert [t.token_id for t in lps[rid]] == toks[rid]
        for j, t in enumerate(lps[rid]):
            assert abs(t.logprob - ref[j, t.token_id].item()) < 1e-4
            assert len(t.top_logprobs) == n
            if n:
                v, i = ref[j].topk(n)
                assert [a for a, _ in t.top_logprobs] == i.tolist()
                assert torch.allclose(torch.tensor([b for _, b in t.top_logprobs]), v, atol=1e-4)
    assert_all_free(engine)


# ---- the sampler at its extremes ---------------------------------------------------------------

V = 257
CPU = torch.device("cpu")


def sample(x: torch.Tensor, params: SamplingParams, seeds, output=()) -> list[int]:
    rows = []
    for s in seeds:
        r = Request("r", [1, 2, 3], params, seed=s, arrival_time=0.0)
        r.output_token_ids = list(output)
        rows.append(SampleRow(r, len(output)))
    out = Sampler(KernelDispatch(CPU), CPU)(x.expand(len(rows), -1).contiguous(), rows)
    return [t.token_id for t in out]


def test_truncation_extremes():
    x = torch.randn(1, V) * 2.0
    top = int(x.argmax())
    seeds = [random.randrange(1 << 62) for _ in range(200)]
    plain = sample(x, SamplingParams(temperature=1.0), seeds)
    assert len(set(plain)) > 5
    # top_k beyond the vocabulary is no truncation at all (same draws as top_k off)
    assert sample(x, SamplingParams(temperature=1.0, top_k=V + 1000), seeds) == plain
    assert sample(x, SamplingParams(temperature=1.0, top_k=-1), seeds) == plain
    # the tiniest top_p keeps exactly the most likely token; min_p = 1 keeps only the max
    assert set(sample(x, SamplingParams(temperature=1.0, top_p=1e-9), seeds)) == {top}
    assert set(sample(x, SamplingParams(temperature=1.0, min_p=1.0), seeds)) == {top}
    # a tiny but nonzero temperature is sampling that all but always lands on the max: finite,
    # and the raw logprobs stay finite too
    x2 = x.clone()
    x2[0, top] += 0.01  # a clear winner at T = 1e-4 (gap / T = 100 >> Gumbel spread)
    p = SamplingParams(temperature=1e-4, logprobs=1)
    assert set(sample(x2, p, seeds)) == {top}


def test_logit_bias_forces_a_token_and_out_of_vocab_bias_is_rejected(rng):
    x = torch.randn(1, V) * 3.0
    target = random.randrange(V)
    seeds = [random.randrange(1 << 62) for _ in range(50)]
    for p in (
        SamplingParams(temperature=1.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=1.5, top_k=1, logit_bias={target: 100.0}),
    ):
        assert set(sample(x, p, seeds)) == {target}
    # -100 bans a token for all practical purposes
    p = SamplingParams(temperature=0.0, logit_bias={int(x.argmax()): -100.0})
    assert sample(x, p, [0]) != [int(x.argmax())]
    # vLLM rejects logit_bias ids outside the vocabulary instead of ignoring them silently
    engine = make_engine(ARCH)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("oov", [1, 2], SamplingParams(logit_bias={VOCAB: 5.0}))
    assert not engine.has_unfinished_requests()


def test_penalty_semantics_prompt_versus_output():
    """repetition: over prompt and output tokens (divide positive logits, multiply negative);
    presence and frequency: over output tokens only, frequency by count (vLLM / OpenAI)."""
    x = torch.zeros(1, V)
    a, b, c, d = 10, 20, 30, 40
    x[0, a], x[0, b], x[0, c], x[0, d] = 4.0, -2.0, 3.0, 1.0
    sampler = Sampler(KernelDispatch(CPU), CPU)
    r = Request("r", [a, b], SamplingParams(), seed=0, arrival_time=0.0)
    r.output_token_ids = [c, c, d]
    work = x.clone()
    r.params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    sampler._apply_penalties(work, [SampleRow(r, 3)], V)
    want = x.clone()
    want[0, a] = 4.0 / 2  # prompt only: repetition, no presence / frequency
    want[0, b] = -2.0 * 2
    want[0, c] = 3.0 / 2 - 0.5 - 2 * 0.25
    want[0, d] = 1.0 / 2 - 0.5 - 1 * 0.25
    assert torch.allclose(work, want), (work[0, [a, b, c, d]], want[0, [a, b, c, d]])
    # the output seen is the first output_pos tokens (a prefill row of a resumed request sees
    # every resumed token: output_pos = len(output))
    work = x.clone()
    sampler._apply_penalties(work, [SampleRow(r, 1)], V)
    assert abs(work[0, c].item() - (3.0 / 2 - 0.5 - 0.25)) < 1e-6
    assert abs(work[0, d].item() - 1.0) < 1e-6


def test_penalties_resume_after_failover_exactly(rng):
    prompt = rand_prompt(rng, 5, 30)
    p = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=rng.randrange(1 << 30),
        ignore_eos=True,
        repetition_penalty=1.8,
        presence_penalty=1.2,
        frequency_penalty=1.5,
    )
    engine = make_engine(ARCH)
    toks, _, _ = run(engine, {"full": (prompt, p)})
    full = toks["full"]
    # greedy with the same penalties: a penalty over resumed outputs changes the argmax, so a
    # resume that forgot them would diverge
    pg = SamplingParams(**{**p.to_dict(), "temperature": 0.0})
    toks, _, _ = run(engine, {"full_g": (prompt, pg)})
    full_g = toks["full_g"]
    for k in (1, rng.randrange(2, 11), 11):
        e = make_engine(ARCH, max_num_batched_tokens=16)
        got = {"s": [], "g": []}
        for rid, params, ref in (("s", p, full), ("g", pg, full_g)):
            e.add_request(rid, prompt, params, output_token_ids=ref[:k])
        while e.has_unfinished_requests():
            for out in e.step():
                got[out.request_id] += out.new_token_ids
        assert got["s"] == full[k:] and got["g"] == full_g[k:], k
        assert_all_free(e)


# ---- aborts and request ids --------------------------------------------------------------------


def test_aborts_are_idempotent_and_ids_reusable_after_finish(rng):
    """Unknown, repeated and late aborts are no-ops (they do arrive that way over the streams).
    An id in use is rejected; once finished or aborted it may be used again (vLLM likewise only
    rejects ids of requests it still runs), and the reuse behaves like a fresh request."""
    engine = make_engine(ARCH)
    assert engine.abort_request("nobody") == []
    prompt = rand_prompt(rng, 20, 40)
    engine.add_request("x", prompt, greedy(5))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompt, greedy(5))
    toks, fin, _ = run(engine, {})
    want = toks["x"]
    assert_greedy(ARCH, prompt, want, 5, True)
    assert fin["x"] == "length"
    # "x" finished; aborting it now is a no-op
    assert engine.abort_request(["x", "x"]) == []
    toks, fin, _ = run(engine, {"x": (prompt, greedy(5))})
    assert toks["x"] == want and fin["x"] == "length"
    # double abort while running: one abort output, then nothing
    engine.add_request("y", prompt, greedy(5))
    engine.step()
    [out] = engine.abort_request(["y", "y", "nobody"])
    assert out.request_id == "y" and out.finish_reason == "abort"
    assert engine.abort_request("y") == []
    assert engine.step() == []
    toks, fin, _ = run(engine, {"y": (prompt, greedy(5))})
    assert toks["y"] == want
    assert_all_free(engine)


# ---- shared prompts ----------------------------------------------------------------------------


def test_prefix_of_each_other_and_identical_prompts_while_prefilling(rng):
    engine = make_engine(ARCH, max_num_batched_tokens=16)
    long = rand_prompt(rng, 70, 70)
    prompts = {
        "long": long,
        "same": list(long),  # identical, submitted while "long" is still prefilling
        "prefix": long[:33],  # a prefix of the others
        "longer": long + rand_prompt(rng, 5, 20),  # the others are its prefixes
        "block": long[:32],  # exactly two blocks
    }
    engine.add_request("long", long, greedy(6))
    engine.step()
    assert 0 < engine.requests["long"].num_computed_tokens < len(long)
    reqs = {k: (v, greedy(6)) for k, v in prompts.items() if k != "long"}
    toks, _, _ = run(engine, reqs)
    for rid, prompt in prompts.items():
        assert_greedy(ARCH, prompt, toks[rid], 6, True)
    first = toks["long"]
    assert engine.stats().prefix_cache_hits > 0
    # the same prompt again, after everything: all but the last token from the cache
    before = engine.stats().prefix_cache_hits
    toks, _, _ = run(engine, {"again": (long, greedy(6))})
    assert toks["again"] == first
    assert engine.stats().prefix_cache_hits - before == (len(long) - 1) // 16 * 16
    assert_all_free(engine)


def test_preempting_a_request_with_a_prefix_hit(rng):
    # 8 blocks: 3 shared + at least 3 private blocks per request, so three cannot all finish
    engine = make_engine(ARCH, num_kv_blocks=8)
    shared = rand_prompt(rng, 48, 48)
    toks, _, _ = run(engine, {"warm": (shared + [5], greedy(2))})
    reqs = {f"r{i}": (shared + rand_prompt(rng, 1, 20), greedy(40)) for i in range(3)}
    for rid, (prompt, p) in reqs.items():
        engine.add_request(rid, prompt, p)
    objs = dict(engine.requests)
    toks, fin, _ = run(engine, {})
    assert engine.stats().num_preemptions_total > 0
    # some preempted request had (and, on re-admission, again had) a prefix-cache hit
    assert any(r.num_preemptions and r.num_cached_tokens >= 48 for r in objs.values())
    for rid, (prompt, _) in reqs.items():
        assert_greedy(ARCH, prompt, toks[rid], 40, True)
    # Reported cached tokens (usage.prompt_tokens_details) are prompt tokens served from the
    # cache at first admission, as in vLLM: a re-admission after preemption, which hits the
    # request's own generated tokens too, must neither exceed the prompt nor change the count.
    for r in objs.values():
        assert r.num_cached_tokens == 48, (r.request_id, r.num_cached_tokens)
        assert fin[rid] == "length"
    assert_all_free(engine)


def test_kv_pool_of_exactly_one_request(rng):
    # 4 blocks = 64 tokens: max_model_len is capped there, and every request can fill it
    engine = make_engine(ARCH, num_kv_blocks=4, max_model_len=64, max_num_batched_tokens=32)
    assert engine.max_model_len == 64
    reqs = {}
    for i in range(6):
        prompt = rand_prompt(rng, 1, 63)
        reqs[f"r{i}"] = (prompt, greedy(rng.choice([3, 100])))
    toks, fin, _ = run(engine, reqs)
    for rid, (prompt, p) in reqs.items():
        n = min(p.max_tokens, 64 - len(prompt))
        assert_greedy(ARCH, prompt, toks[rid], n, True)
        assert fin[rid] == "length"
    assert_all_free(engine)
