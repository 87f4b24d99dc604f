"""Scheduling tests against KVEchoRunner (a real paged token cache, no model): fast enough to
hammer the batcher with random workloads, strict enough to catch any block bookkeeping error."""

import random

import pytest
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.request import RequestStatus
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.engine.kv_echo_runner import KVEchoRunner, echo_reference


def make_engine(num_blocks=64, max_seqs=256, budget=8192, caching=True, **runner_kw):
    runner = KVEchoRunner(num_blocks, **runner_kw)
    cfg = EngineConfig(
        model="none",
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        seed=1234,
    )
    return LLMEngine(cfg, runner=runner), runner


def run_all(engine: LLMEngine, outputs: dict[str, list[int]], finish: dict[str, str]) -> None:
    while engine.has_unfinished_requests():
        step(engine, outputs, finish)


def step(engine, outputs, finish):
    for out in engine.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            assert out.request_id not in finish
            finish[out.request_id] = out.finish_reason


def assert_all_free(engine: LLMEngine) -> None:
    assert engine.check_all_free()
    bm = engine.block_manager
    assert all(c == 0 for c in bm.ref_counts)
    bm.check_invariants()
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0


def test_single_request_matches_reference():
    engine, runner = make_engine()
    rng = random.Random(0)
    prompt = [rng.randrange(97) for _ in range(37)]
    p = SamplingParams(max_tokens=20, temperature=0.0)
    assert engine.generate([prompt], p) == [
        echo_reference(runner, prompt, p, 0, engine.max_model_len)
    ]
    assert_all_free(engine)
    s = engine.stats()
    assert s.generation_tokens_total == 20 and s.prompt_tokens_total == 37


def test_plan_shape_budget_and_seq_cap():
    engine, runner = make_engine(num_blocks=200, max_seqs=5, budget=24)
    rng = random.Random(1)
    for i in range(12):
        engine.add_request(
            f"r{i}",
            [rng.randrange(97) for _ in range(rng.randrange(1, 60))],
            SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0),
        )
    while engine.has_unfinished_requests():
        engine.step()
    for plan in runner.plans:
        assert sum(n for _, n, _, _ in plan) <= 24
        assert len(plan) <= 5
        # Decodes (one token of a request past its first step) come first.
        kinds = [n == 1 and done > 0 and samples for _, n, done, samples in plan]
        assert kinds == sorted(kinds, reverse=True)
    seen_chunk = any(not samples for plan in runner.plans for *_, samples in plan)
    assert seen_chunk
    assert_all_free(engine)


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_preemption_and_aborts(seed, lookahead):
    """Requests arrive over time with shared prefixes, under a tiny budget and KV pool; some are
    aborted. Every finished request produces exactly what it produces alone. lookahead: the
    pipelined runner's extra decode slot (blocks taken a step early, never by preemption)."""
    rng = random.Random(seed)
    caching = seed % 3 != 2
    engine, runner = make_engine(
        num_blocks=rng.choice([8, 12, 20]),
        max_seqs=rng.choice([3, 8, 64]),
        budget=rng.choice([5, 16, 40, 200]),
        caching=caching,
        eos_token_ids=(3,),
    )
    engine.batcher.lookahead_slots = lookahead
    bases = [[rng.randrange(97) for _ in range(40)] for _ in range(3)]
    todo = []
    for i in range(24):
        prefix = rng.choice(bases)[: rng.randrange(0, 40)]
        prompt = prefix + [rng.randrange(97) for _ in range(rng.randrange(1, 20))]
        p = SamplingParams(
            max_tokens=rng.randrange(1, 30),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.choice([None, rng.randrange(1 << 30)]),
            ignore_eos=rng.random() < 0.5,
        )
        todo.append((rng.randrange(0, 40), f"r{i}", prompt, p))
    todo.sort(key=lambda t: t[0])
    aborted = set()
    reqs = {}
    outputs, finish = {}, {}
    t = 0
    while todo or engine.has_unfinished_requests():
        while todo and todo[0][0] <= t:
            _, rid, prompt, p = todo.pop(0)
            engine.add_request(rid, prompt, p)
            reqs[rid] = engine.requests[rid]
        if rng.random() < 0.04 and engine.requests:
            rid = rng.choice(sorted(engine.requests))
            outs = engine.abort_request([rid])
            assert [o.finish_reason for o in outs] == ["abort"]
            aborted.add(rid)
        step(engine, outputs, finish)
        engine.block_manager.check_invariants()
        t += 1
    assert_all_free(engine)
    stats = engine.stats()
    assert engine.abort_request(list(aborted)) == []  # idempotent
    assert set(finish) | aborted == set(reqs) and not set(finish) & aborted
    assert all(reason in ("stop", "length") for reason in finish.values())
    # Each finished request produced exactly what it produces alone (with the seed the engine
    # recorded for it); an aborted one a prefix of that.
    for rid, req in reqs.items():
        want = echo_reference(
            runner, req.prompt_token_ids, req.params, req.seed, engine.max_model_len
        )
        got = outputs.get(rid, [])
        assert req.output_token_ids == got
        if rid in aborted:
            assert got == want[: len(got)], rid
        else:
            assert got == want, rid
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits
    if not caching:
        assert stats.prefix_cache_hits == 0


@pytest.mark.parametrize("lookahead", [0, 1])
def test_lookahead_slot_takes_the_next_block_a_step_early(lookahead):
    """With one slot of lookahead, after every step a decoding request already holds the block
    of the position its next step computes (what a step launched ahead writes); without it, it
    gets that block only when the step is scheduled."""
    engine, _ = make_engine(num_blocks=8)
    engine.batcher.lookahead_slots = lookahead
    bs = engine.block_manager.block_size
    p = SamplingParams(max_tokens=2 * bs + 3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, bs)), p)  # bs - 1 prompt tokens
    req = engine.requests["a"]
    outputs, finish = {}, {}
    covered = []
    while engine.has_unfinished_requests():
        step(engine, outputs, finish)
        if engine.has_unfinished_requests():
            covered.append(len(req.block_ids) * bs > req.num_computed_tokens)
    assert finish == {"a": "length"} and len(outputs["a"]) == 2 * bs + 3
    assert all(covered) if lookahead else not all(covered)
    assert_all_free(engine)


def test_lookahead_never_preempts():
    """No free block: the lookahead waits and nothing is preempted for it."""
    engine, _ = make_engine(num_blocks=3)
    engine.batcher.lookahead_slots = 1
    bs = engine.block_manager.block_size
    p = SamplingParams(max_tokens=bs, temperature=0.0, ignore_eos=True)
    # Two requests at one block each, one free block: each crosses into its second block.
    engine.add_request("b", list(range(1, bs - 1)), p)
    engine.add_request("c", list(range(1, bs - 1)), p)
    outputs, finish = {}, {}
    run_all(engine, outputs, finish)
    assert finish == {"b": "length", "c": "length"}
    assert engine.batcher.num_preemptions == 1  # the one a plain batcher has too
    assert_all_free(engine)


def test_add_request_validation():
    engine, _ = make_engine(num_blocks=8, vocab_size=50)  # 128-token capacity caps max_model_len
    assert engine.max_model_len == 128
    p = SamplingParams(max_tokens=4)
    engine.add_request("ok", [1, 2, 3], p)
    cases = [
        ("ok", [1], p, None, "already in use"),
        ("empty", [], p, None, "empty"),
        ("vocab", [1, 50], p, None, "outside the vocabulary"),
        ("neg", [-1], p, None, "outside the vocabulary"),
        ("outvocab", [1], p, [99], "outside the vocabulary"),
        ("long", list(range(40)) * 4, p, None, "max_model_len"),
        ("params", [1], SamplingParams(max_tokens=0), None, "max_tokens"),
        ("temp", [1], SamplingParams(temperature=3.0), None, "temperature"),
        ("done", [1], SamplingParams(max_tokens=2), [4, 5], "nothing left"),
    ]
    for rid, prompt, params, out, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(rid, prompt, params, output_token_ids=out)
    assert list(engine.requests) == ["ok"]
    # A prompt that fits but whose max_tokens would not: accepted, stops at max_model_len.
    engine.add_request("clamp", list(range(40)) * 3, SamplingParams(max_tokens=50))
    out, fin = {}, {}
    run_all(engine, out, fin)
    assert fin["clamp"] == "length" and len(out["clamp"]) == 128 - 120
    assert_all_free(engine)


def test_stop_rules():
    engine, runner = make_engine(eos_token_ids=(7,))
    prompts = [[i, i + 1, i + 2] for i in range(30)]
    variants = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, min_tokens=10),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[11, 12], ignore_eos=True),
    ]
    saw_stop = 0
    for p in variants:
        results = engine.generate(prompts, p)
        for prompt, got in zip(prompts, results):
            p_eos = SamplingParams(**{**p.to_dict(), "eos_token_ids": [7]})
            assert got == echo_reference(runner, prompt, p_eos, 0, engine.max_model_len)
            if len(got) < 40:
                saw_stop += 1
                assert got[-1] in ([11, 12] if p.stop_token_ids else [7])
                assert len(got) >= p.min_tokens
            if p.ignore_eos and not p.stop_token_ids:
                assert len(got) == 40
    assert saw_stop > 0
    assert_all_free(engine)


def test_seeded_sampling_independent_of_batch_and_order():
    rng = random.Random(3)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(1, 50))] for _ in range(10)]
    params = [SamplingParams(max_tokens=15, temperature=1.0, seed=100 + i) for i in range(10)]
    alone = []
    for pr, p in zip(prompts, params):
        engine, _ = make_engine()
        alone.append(engine.generate([pr], p)[0])
    for order_seed in range(3):
        order = list(range(10))
        random.Random(order_seed).shuffle(order)
        engine, _ = make_engine(num_blocks=16, budget=20)
        got = engine.generate([prompts[i] for i in order], [params[i] for i in order])
        assert [got[order.index(i)] for i in range(10)] == alone
    # Engine-drawn seeds come from config.seed: the same engine config draws the same seeds.
    unseeded = SamplingParams(max_tokens=15, temperature=1.0)
    a = make_engine()[0].generate(prompts[:3], unseeded)
    b = make_engine()[0].generate(prompts[:3], unseeded)
    assert a == b and len({tuple(x) for x in a}) == 3


def test_failover_resume_continues_exactly():
    rng = random.Random(4)
    for temperature in (0.0, 1.0):
        prompt = [rng.randrange(97) for _ in range(21)]
        p = SamplingParams(max_tokens=25, temperature=temperature, seed=77, ignore_eos=True)
        full = make_engine()[0].generate([prompt], p)[0]
        for k in (1, 5, 11, 24):
            engine, _ = make_engine()
            engine.add_request("resumed", prompt, p, output_token_ids=full[:k])
            out, fin = {}, {}
            run_all(engine, out, fin)
            assert out["resumed"] == full[k:] and fin["resumed"] == "length"
            assert engine.stats().generation_tokens_total == 25 - k
            assert_all_free(engine)


def test_abort_mid_prefill_and_mid_decode():
    engine, _ = make_engine(budget=16)
    rng = random.Random(5)
    engine.add_request("long", [rng.randrange(97) for _ in range(100)], SamplingParams())
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    long_req = engine.requests["long"]
    assert 0 < long_req.num_computed_tokens < 100 and long_req.block_ids
    [out] = engine.abort_request("long")
    assert out.finish_reason == "abort" and out.new_token_ids == []
    assert long_req.status is RequestStatus.FINISHED and long_req.block_ids == []
    outs = []
    for _ in range(5):
        outs += engine.step()
    assert [o.request_id for o in outs] == ["short"] * 5
    short_req = engine.requests["short"]
    assert short_req.num_output_tokens == 5
    engine.add_request("waiting", [5] * 10, SamplingParams())
    aborted = engine.abort_request(["short", "waiting", "unknown"])
    assert [o.request_id for o in aborted] == ["short", "waiting"]
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_all_free(engine)


def test_prefix_hit_on_blocks_of_a_request_still_running():
    """Blocks are registered as soon as they are computed: a request arriving while the first
    is still in (chunked) prefill already hits the part computed so far."""
    engine, runner = make_engine(num_blocks=64, budget=40)
    rng = random.Random(6)
    prefix = [rng.randrange(97) for _ in range(96)]
    p = SamplingParams(max_tokens=5, temperature=0.0)
    engine.add_request("a", prefix + [1, 2, 3], p)
    engine.step()
    engine.step()  # a has computed 80 tokens = 5 blocks, and is still prefilling
    a = engine.requests["a"]
    assert a.num_computed_tokens == 80
    engine.add_request("b", prefix + [4, 5], p)
    out, fin = {}, {}
    step(engine, out, fin)
    b = engine.requests["b"]
    # a took 19 tokens of the budget to finish its prompt, b the other 21 after its 80 cached.
    assert b.num_cached_tokens == 80 and b.block_ids[:5] == a.block_ids[:5]
    assert b.num_computed_tokens == 80 + 18 and engine.stats().prefix_cache_hits == 80
    run_all(engine, out, fin)
    for rid, prompt in (("a", prefix + [1, 2, 3]), ("b", prefix + [4, 5])):
        assert out[rid] == echo_reference(runner, prompt, p, 0, engine.max_model_len)
    assert_all_free(engine)


def test_schedule_without_admission_holds_waiting_requests(rng):
    """schedule(admit=False) (a pipelined decode step in flight) plans the running decodes only
    and says that waiting requests were held back; the next schedule admits them."""
    engine, _ = make_engine(max_seqs=4)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [rng.randrange(97) for _ in range(rng.randrange(1, 30))], p)
    engine.step()  # a's prefill
    engine.add_request("b", [rng.randrange(97) for _ in range(rng.randrange(1, 30))], p)
    batcher = engine.batcher
    held = batcher.schedule(admit=False)
    assert [s.request.request_id for s in held.scheduled] == ["a"]
    assert held.is_decode_only and held.admit_pending and len(batcher.waiting) == 1
    admitted = batcher.schedule()  # (a plan is not run here: a is planned again as is)
    assert {s.request.request_id for s in admitted.scheduled} == {"a", "b"}
    assert not admitted.admit_pending and not batcher.waiting
    # Nothing waits: nothing is held back, whatever admit says.
    engine.abort_request("b")
    assert not batcher.schedule(admit=False).admit_pending
