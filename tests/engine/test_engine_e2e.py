"""LLMEngine with the real model runner (fp32, CPU) against transformers' greedy decoding on
tiny random checkpoints (teacher-forced on the engine's tokens: a tie may go either way):
batching, chunking, prefix caching, preemption, aborts and failover must never change a
token."""

from __future__ import annotations

import functools

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint
from tests.greedy_reference import TOKEN_ATOL, check_greedy_tokens

VOCAB = 384  # tests/checkpoints.py tokenizer size


@functools.cache
def hf_model(arch: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32)
    model.eval()
    return model


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool) -> list[int]:
    model = hf_model(arch)
    gc = model.generation_config
    eos = gc.eos_token_id
    try:
        if ignore_eos:
            gc.eos_token_id = None
            gc.pad_token_id = 0
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise transformers takes prompt tokens equal to the pad id
            # for padding.
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
            )
    finally:
        gc.eos_token_id = eos
    return out[0, len(prompt) :].tolist()


def assert_greedy(arch: str, prompt, got: list[int], max_tokens: int, ignore_eos: bool) -> None:
    """got: the engine's greedy output of prompt. Each token is transformers' argmax, teacher-
    forced (tests/greedy_reference.py: a tie may go either way); there are max_tokens of them,
    or, with eos honoured, fewer only up to the first eos, where generate stops too."""
    model = hf_model(arch)
    if ignore_eos:
        assert len(got) == max_tokens, (arch, prompt, got)
    else:
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        stop = next((i + 1 for i, t in enumerate(got) if t in eos), max_tokens)
        assert len(got) == stop, (arch, prompt, got, eos)
    check_greedy_tokens(model, list(prompt), got, TOKEN_ATOL)


def make_engine(arch: str = "llama", **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(checkpoint(arch)), device="cpu", dtype="float32", **kw)
    return LLMEngine(cfg)


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def rand_prompt(rng, lo: int, hi: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi + 1))]


def run_staggered(engine: LLMEngine, arrivals, rng=None, abort_at=None):
    """arrivals: [(step, request_id, prompt, params)]. Returns (outputs, finish reasons)."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, params = arrivals.pop(0)
            engine.add_request(rid, prompt, params)
            outputs[rid] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
        assert step < 10_000
    return outputs, finish


def assert_all_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.kv_cache_usage == 0.0
    assert s.num_running == 0 and s.num_waiting == 0
    assert all(c == 0 for c in engine.block_manager.ref_counts)
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_one_request_at_a_time(arch, rng):
    engine = make_engine(arch)
    for lo, hi in ((1, 1), (2, 15), (16, 16), (17, 60)):
        prompt = rand_prompt(rng, lo, hi)
        assert_greedy(arch, prompt, engine.generate([prompt], greedy(8))[0], 8, True)
    # With eos honoured, the engine stops exactly where transformers stops.
    for _ in range(3):
        prompt = rand_prompt(rng, 1, 30)
        got = engine.generate([prompt], greedy(12, ignore_eos=False))[0]
        assert_greedy(arch, prompt, got, 12, False)
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_concurrent_staggered_arrivals(arch, rng):
    engine = make_engine(arch, max_num_seqs=6)
    arrivals = [
        (rng.randrange(0, 12), f"r{i}", rand_prompt(rng, 1, 70), greedy(rng.randrange(1, 12)))
        for i in range(10)
    ]
    outputs, finish = run_staggered(engine, list(arrivals))
    for _, rid, prompt, p in arrivals:
        assert_greedy(arch, prompt, outputs[rid], p.max_tokens, True)
        assert finish[rid] == "length"
    assert_all_free(engine)
    assert engine.stats().generation_tokens_total == sum(a[3].max_tokens for a in arrivals)


def test_chunked_prefill_tiny_budget(rng):
    engine = make_engine("qwen2", max_num_batched_tokens=16)
    arrivals = [
        (rng.randrange(0, 6), f"r{i}", rand_prompt(rng, 10, 80), greedy(rng.randrange(2, 8)))
        for i in range(8)
    ]
    outputs, _ = run_staggered(engine, list(arrivals))
    for _, rid, prompt, p in arrivals:
        assert_greedy("qwen2", prompt, outputs[rid], p.max_tokens, True)
    assert_all_free(engine)


def test_shared_prefix_hits_prefix_cache(rng):
    engine = make_engine("llama")
    prefix = rand_prompt(rng, 50, 50)  # 3 full blocks + 2 tokens
    first = prefix + rand_prompt(rng, 1, 10)
    want = engine.generate([first], greedy(6))[0]
    assert_greedy("llama", first, want, 6, True)
    before = engine.stats()
    assert before.prefix_cache_hits == 0
    others = [prefix + rand_prompt(rng, 1, 20) for _ in range(5)]
    got = engine.generate(others, greedy(6))
    for prompt, out in zip(others, got):
        assert_greedy("llama", prompt, out, 6, True)
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 5 * 48
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(map(len, others))
    # The exact same prompt again: everything but the last token can come from the cache.
    assert engine.generate([first], greedy(6))[0] == want
    assert engine.stats().prefix_cache_hits - after.prefix_cache_hits == (len(first) - 1) // 16 * 16
    assert_all_free(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_tiny_kv_pool(caching, rng):
    engine = make_engine("mistral", num_kv_blocks=8, enable_prefix_caching=caching)
    # 8 blocks of 16 tokens; prompts of 17-32 tokens take 2 blocks each, so four running
    # requests fill the pool, and each needs a third block within 16 tokens of output (up to 47):
    # preemption is certain, whatever the draw (a looser draw once produced none).
    arrivals = [
        (rng.randrange(0, 2), f"r{i}", rand_prompt(rng, 17, 32), greedy(rng.randrange(33, 48)))
        for i in range(8)
    ]
    outputs, _ = run_staggered(engine, list(arrivals))
    for _, rid, prompt, p in arrivals:
        assert_greedy("mistral", prompt, outputs[rid], p.max_tokens, True)
    assert engine.stats().num_preemptions_total > 0
    assert_all_free(engine)


def test_seeded_sampling_same_alone_and_in_any_batch(rng):
    prompts = [rand_prompt(rng, 1, 40) for _ in range(6)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 40))
        for _ in prompts
    ]
    engine = make_engine("qwen3")
    alone = [engine.generate([pr], p)[0] for pr, p in zip(prompts, params)]
    for _ in range(2):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        e = make_engine("qwen3", max_num_batched_tokens=32, num_kv_blocks=12)
        arrivals = [(rng.randrange(0, 5), f"s{i}", prompts[i], params[i]) for i in order]
        outputs, _ = run_staggered(e, arrivals)
        assert [outputs[f"s{i}"] for i in range(len(prompts))] == alone
        assert_all_free(e)
    # Sampling is not greedy decoding in disguise.
    assert any(
        a != hf_greedy("qwen3", tuple(p), 10, False)[: len(a)] for a, p in zip(alone, prompts)
    )


def test_aborts_mid_prefill_and_mid_decode(rng):
    engine = make_engine("llama", max_num_batched_tokens=16)
    keep = rand_prompt(rng, 5, 20)
    engine.add_request("keep", keep, greedy(10))
    engine.add_request("prefill", rand_prompt(rng, 60, 90), greedy(10))
    engine.add_request("decode", rand_prompt(rng, 3, 8), greedy(30))
    outputs = {"keep": []}
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            req = engine.requests["prefill"]
            assert 0 < req.num_computed_tokens < req.num_prompt_tokens
            [out] = engine.abort_request(["prefill"])
            assert out.finish_reason == "abort"
        if step == 12:
            assert engine.requests["decode"].num_output_tokens > 0
            [out] = engine.abort_request("decode")
            assert out.finish_reason == "abort"
        for out in engine.step():
            assert out.request_id != "prefill"
            if out.request_id == "keep":
                outputs["keep"] += out.new_token_ids
        step += 1
    assert_greedy("llama", keep, outputs["keep"], 10, True)
    assert_all_free(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_failover_resume(temperature, rng):
    prompt = rand_prompt(rng, 5, 40)
    p = SamplingParams(max_tokens=12, temperature=temperature, seed=rng.randrange(1 << 30))
    p.ignore_eos = True
    engine = make_engine("qwen2")
    full = engine.generate([prompt], p)[0]
    assert len(full) == 12
    if temperature == 0.0:
        assert_greedy("qwen2", prompt, full, 12, True)
    for k in (1, rng.randrange(2, 11), 11):
        e = make_engine("qwen2", max_num_batched_tokens=16)
        e.add_request("resumed", prompt, p, output_token_ids=full[:k])
        outputs, finish = [], None
        while e.has_unfinished_requests():
            for out in e.step():
                outputs += out.new_token_ids
                finish = out.finish_reason or finish
        assert outputs == full[k:] and finish == "length", k
        assert_all_free(e)
