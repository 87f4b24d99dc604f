import random

import pytest
from voltserve.services.executor.block_manager import BlockManager
from voltserve.services.executor.request import Request
from voltserve.shared.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), seed=0, arrival_time=0.0)


def admit(bm: BlockManager, req: Request, num_new: int | None = None) -> int:
    """Admit like the batcher does; returns the number of cached tokens."""
    cached = bm.match_prefix(req)
    num_cached = len(cached) * BS
    if num_new is None:
        num_new = req.num_tokens - num_cached
    assert bm.allocate(req, cached, num_new)
    req.num_computed_tokens = num_cached
    return num_cached


def compute(bm: BlockManager, req: Request, num_new: int) -> None:
    assert bm.append_slots(req, num_new)
    req.num_computed_tokens += num_new
    bm.cache_full_blocks(req)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_allocate_append_free_refcounts():
    rng = random.Random(1)
    bm = BlockManager(10, BS)
    req = make_request("a", rand_tokens(rng, 40))
    assert admit(bm, req) == 0
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 7
    assert all(bm.ref_counts[b] == 1 for b in req.block_ids)
    req.num_computed_tokens = 40
    bm.cache_full_blocks(req)
    # Grow by decode tokens: a new block only at the 49th token.
    for _ in range(8):
        req.output_token_ids.append(rng.randrange(1000))
        compute(bm, req, 1)
        assert len(req.block_ids) == 3
    req.output_token_ids.append(rng.randrange(1000))
    compute(bm, req, 1)
    assert len(req.block_ids) == 4 and bm.num_free_blocks == 6
    bm.check_invariants()
    bm.free(req)
    assert req.block_ids == [] and bm.num_free_blocks == 10
    assert all(c == 0 for c in bm.ref_counts)
    # 3 full blocks were registered and stay hittable while free.
    assert bm.num_cached_free_blocks == 3
    bm.check_invariants()
    with pytest.raises(ValueError):
        BlockManager(0, BS)


def test_prefix_hits_share_blocks_and_never_cover_whole_prompt():
    rng = random.Random(2)
    bm = BlockManager(32, BS)
    prefix = rand_tokens(rng, 3 * BS)
    a = make_request("a", prefix + rand_tokens(rng, 5))
    assert admit(bm, a) == 0
    compute(bm, a, 0)  # nothing computed yet: nothing registered
    assert bm.match_prefix(make_request("x", prefix + [1])) == []
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)

    b = make_request("b", prefix + rand_tokens(rng, 20))
    assert admit(bm, b) == 3 * BS
    assert b.block_ids[:3] == a.block_ids[:3]
    assert all(bm.ref_counts[x] == 2 for x in a.block_ids[:3])
    assert bm.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert bm.prefix_cache_hits == 3 * BS

    # A prompt that is exactly the cached prefix: the last block is recomputed.
    c = make_request("c", list(prefix))
    assert admit(bm, c) == 2 * BS
    assert c.block_ids[:2] == a.block_ids[:2] and c.block_ids[2] != a.block_ids[2]

    # Same tokens at a different depth do not hit: the hash chains over the parent.
    d = make_request("d", prefix[BS:] + rand_tokens(rng, 3))
    assert admit(bm, d) == 0

    # A different first block breaks the chain even when later blocks agree.
    e = make_request("e", rand_tokens(rng, BS) + prefix[BS:] + [7])
    assert admit(bm, e) == 0
    bm.check_invariants()
    for r in (a, b, c, d, e):
        bm.free(r)
    assert bm.num_free_blocks == 32 and all(x == 0 for x in bm.ref_counts)
    bm.check_invariants()


def test_freed_cached_blocks_hit_until_evicted_lru():
    rng = random.Random(3)
    bm = BlockManager(8, BS)
    p1 = rand_tokens(rng, 2 * BS + 1)
    p2 = rand_tokens(rng, 2 * BS + 1)
    r1 = make_request("r1", p1)
    admit(bm, r1)
    compute(bm, r1, 0)
    r1.num_computed_tokens = r1.num_tokens
    bm.cache_full_blocks(r1)
    bm.free(r1)
    r2 = make_request("r2", p2)
    admit(bm, r2)
    r2.num_computed_tokens = r2.num_tokens
    bm.cache_full_blocks(r2)
    bm.free(r2)
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 8

    # Both prefixes hit while nothing needed their blocks.
    assert len(bm.match_prefix(make_request("q1", p1))) == 2
    assert len(bm.match_prefix(make_request("q2", p2))) == 2

    # 4 plain blocks remain: a 4-block request evicts nothing.
    big = make_request("big", rand_tokens(rng, 4 * BS))
    admit(bm, big)
    assert bm.num_cached_free_blocks == 4
    # One more block evicts the least recently freed: r1's tail block first (tail freed first).
    more = make_request("more", rand_tokens(rng, 5))
    admit(bm, more)
    assert len(bm.match_prefix(make_request("q1", p1))) == 1
    assert len(bm.match_prefix(make_request("q2", p2))) == 2
    # Touching r2's prefix makes it used; the next eviction takes r1's head block.
    hit = make_request("hit", p2)
    assert admit(bm, hit) == 2 * BS
    assert bm.num_free_blocks == 0
    bm.free(more)
    assert bm.num_free_blocks == 1
    bm.check_invariants()
    for r in (big, hit):
        bm.free(r)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocate_refuses_without_side_effects_when_short():
    rng = random.Random(4)
    bm = BlockManager(4, BS)
    a = make_request("a", rand_tokens(rng, 2 * BS + 1))
    admit(bm, a)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = make_request("b", rand_tokens(rng, 2 * BS))
    cached = bm.match_prefix(b)
    assert not bm.can_allocate(b, cached, b.num_tokens)
    assert not bm.allocate(b, cached, b.num_tokens)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert bm.prefix_cache_queries == a.num_tokens  # a refused admission is not a query
    assert not bm.append_slots(a, 2 * BS)
    assert len(a.block_ids) == 3
    bm.free(a)
    # Hitting a's free cached blocks counts them against the free pool too.
    c = make_request("c", a.prompt_token_ids[: 2 * BS] + rand_tokens(rng, 2 * BS + 1))
    cached = bm.match_prefix(c)
    assert len(cached) == 2
    assert not bm.can_allocate(c, cached, c.num_tokens - 2 * BS)
    assert bm.can_allocate(c, cached, 2 * BS)
    bm.check_invariants()


def test_duplicate_prefix_computed_twice_stays_private():
    rng = random.Random(5)
    bm = BlockManager(16, BS)
    prompt = rand_tokens(rng, 2 * BS + 3)
    a, b = make_request("a", prompt), make_request("b", prompt)
    admit(bm, a)
    admit(bm, b)  # admitted in the same step: no hit, both compute the prefix
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    assert set(a.block_ids).isdisjoint(b.block_ids)
    a_blocks = list(a.block_ids)
    bm.free(a)
    bm.free(b)
    # Only a's copies are registered; b's went back to the plain free list.
    assert bm.num_cached_free_blocks == 2
    c = make_request("c", prompt)
    assert admit(bm, c) == 2 * BS
    assert c.block_ids[:2] == a_blocks[:2]
    bm.free(c)
    bm.check_invariants()


def test_prefix_caching_disabled():
    rng = random.Random(6)
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = rand_tokens(rng, 3 * BS)
    a = make_request("a", prompt)
    admit(bm, a)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert admit(bm, make_request("b", prompt)) == 0
    assert bm.prefix_cache_hits == 0


def test_random_workload_keeps_invariants():
    """Many requests with shared prefixes grow, free and get preempted; refcounts stay exact."""
    rng = random.Random(7)
    bm = BlockManager(24, BS)
    bases = [rand_tokens(rng, rng.randrange(1, 60)) for _ in range(4)]
    live: list[Request] = []
    for step in range(400):
        if live and rng.random() < 0.3:
            bm.free(live.pop(rng.randrange(len(live))), finished=rng.random() < 0.7)
        elif rng.random() < 0.4:
            toks = rng.choice(bases)[: rng.randrange(1, 60)] + rand_tokens(
                rng, rng.randrange(1, 20)
            )
            req = make_request(f"r{step}", toks)
            cached = bm.match_prefix(req)
            n = min(req.num_tokens - len(cached) * BS, rng.randrange(1, 40))
            if bm.allocate(req, cached, n):
                req.num_computed_tokens = len(cached) * BS + n
                bm.cache_full_blocks(req)
                live.append(req)
        elif live:
            req = rng.choice(live)
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(rng.randrange(1000))
            n = req.num_tokens - req.num_computed_tokens
            if bm.append_slots(req, n):
                req.num_computed_tokens += n
                bm.cache_full_blocks(req)
        used = sum(len(r.block_ids) for r in live)
        shared = used - len({b for r in live for b in r.block_ids})
        assert bm.num_free_blocks == 24 - (used - shared)
        bm.check_invariants()
    for r in live:
        bm.free(r)
    assert bm.num_free_blocks == 24 and all(c == 0 for c in bm.ref_counts)
    assert bm.prefix_cache_hits > 0


def test_state_slots_follow_the_blocks(rng):
    """A model with linear-attention state: a request takes a state slot with its first blocks
    and gives it back whenever they are freed; no slot left, no admission."""
    from voltserve.services.executor.state_cache import StateSlots

    bm = BlockManager(16, BS, enable_prefix_caching=False, state_slots=StateSlots(2))
    a, b, c = (make_request(r, rand_tokens(rng, rng.randint(1, 40))) for r in "abc")
    admit(bm, a)
    admit(bm, b)
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not bm.can_allocate(c, [], 1) and not bm.allocate(c, [], 1)
    assert c.state_slot == -1 and not c.block_ids
    slot = a.state_slot
    bm.free(a, finished=False)  # preemption gives the slot back with the blocks
    assert a.state_slot == -1 and not bm.all_free()
    admit(bm, c)
    assert c.state_slot == slot
    bm.free(b)
    bm.free(c)
    assert bm.all_free()
