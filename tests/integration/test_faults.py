"""Fault tests on the real CPU stack (separate processes, real valkey): executors, renderers and
gateways die with kill -9 while requests are in flight, and the clients notice nothing."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest
import redis
from voltserve.services.scheduler.failover import Tracked
from voltserve.shared import streams

from .conftest import CLAIM_IDLE_MS, start_stack

VOCAB = 384  # tests/checkpoints.py tokenizer


@pytest.fixture(scope="module")
def faults_stack(tiny_model, tmp_path_factory):
    s = start_stack(
        tiny_model, tmp_path_factory.mktemp("faults"), gateways=2, renderers=2, executors=2
    )
    yield s
    s.stop()


def client(stack, gateway="gateway-0") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url(gateway) + "/v1", api_key="x", max_retries=0, timeout=120
    )


def rand_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))]


async def stream_completion(c, prompt, max_tokens, progress=None, key=None):
    """Stream one greedy completion; returns (text, completion_tokens, finish_reason)."""
    s = await c.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, finish = [], None, None
    async for chunk in s:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text.append(ch.text)
            finish = ch.finish_reason or finish
            if progress is not None:
                progress[key] = progress.get(key, 0) + 1
    return "".join(text), usage, finish


async def reference(c, prompts, max_tokens):
    """Undisturbed greedy outputs, one request at a time."""
    return [await stream_completion(c, p, max_tokens) for p in prompts]


async def reference_batch(c, prompts, max_tokens):
    """Undisturbed greedy outputs, all requests at once: what `reference` gives (the 200-stream
    test holds concurrent outputs to it), in the steps of one request of max_tokens."""
    return list(await asyncio.gather(*(stream_completion(c, p, max_tokens) for p in prompts)))


def routes_on(stack, executor_id: str) -> int:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        recs = [Tracked.from_record(v) for v in r.hvals(streams.scheduler_routes_key())]
    finally:
        r.close()
    return sum(t.executor_id == executor_id for t in recs)


async def test_200_concurrent_streams_lose_and_repeat_nothing(faults_stack):
    rng = random.Random(random.getrandbits(64))
    prompts = [rand_prompt(rng) for _ in range(10)]
    c = client(faults_stack)
    ref = await reference(c, prompts, 8)
    assert all(n == 8 for _, n, _ in ref)
    order = [i % len(prompts) for i in range(200)]
    rng.shuffle(order)
    clients = [c, client(faults_stack, "gateway-1")]
    t0 = time.monotonic()
    got = await asyncio.gather(
        *(stream_completion(clients[k % 2], prompts[i], 8) for k, i in enumerate(order))
    )
    assert time.monotonic() - t0 < 60
    for i, out in zip(order, got):
        assert out == ref[i]


async def test_executor_kill9_mid_stream_fails_over(faults_stack):
    s = faults_stack
    rng = random.Random(random.getrandbits(64))
    prompts = [rand_prompt(rng) for _ in range(8)]
    # Long outputs (prompt + output < max_model_len 512) keep them in flight for a while: a
    # tiny model on CPU streams a few hundred tokens a second per request.
    max_tokens = 400
    c = client(s)
    ref = await reference_batch(c, prompts, max_tokens)
    progress: dict[int, int] = {}
    tasks = [
        asyncio.create_task(stream_completion(c, p, max_tokens, progress, i))
        for i, p in enumerate(prompts)
    ]
    while sum(progress.values()) < len(prompts):
        await asyncio.sleep(0.002)
        assert not any(t.done() and t.exception() for t in tasks)
    # Freeze it first so it dies with requests in flight, then kill -9.
    s.pause("executor-0")
    owned = routes_on(s, "executor-0")
    s.kill("executor-0")
    t_kill = time.monotonic()
    got = await asyncio.gather(*tasks)
    assert owned > 0, "executor-0 had no unfinished request when it was killed"
    assert got == ref
    assert time.monotonic() - t_kill < 30
    s.restart("executor-0")
    s.wait_executor("executor-0", alive=True)
    # The restarted executor takes new work again.
    out = await asyncio.gather(*(stream_completion(c, p, 4) for p in prompts))
    assert [o[1:] for o in out] == [(4, "length")] * len(prompts)


async def test_killed_renderer_work_is_reclaimed(faults_stack):
    s = faults_stack
    c = client(s)
    r = redis.Redis.from_url(s.redis_url)
    rng = random.Random(random.getrandbits(64))
    try:
        for _attempt in range(5):
            prompt = rand_prompt(rng)
            # Both renderers frozen while blocked in XREADGROUP: the server still hands the new
            # request to one of them, which will never ack it.
            s.pause("renderer-1")
            s.pause("renderer-0")
            task = asyncio.create_task(stream_completion(c, prompt, 6))
            holder = None
            for _ in range(100):
                info = r.xpending(streams.render_stream(), streams.RENDER_GROUP)
                if info["pending"]:
                    holder = next(x["name"].decode() for x in info["consumers"] if x["pending"])
                    break
                await asyncio.sleep(0.01)
            if holder is None:  # neither was blocked at that instant: try again
                s.resume("renderer-0")
                s.resume("renderer-1")
                await task
                continue
            other = "renderer-1" if holder == "renderer-0" else "renderer-0"
            s.kill(holder)
            s.resume(other)
            t0 = time.monotonic()
            text, n, finish = await asyncio.wait_for(task, 30)
            assert (n, finish) == (6, "length")
            # It waited for the reclaim timeout, not for a restart.
            assert time.monotonic() - t0 >= CLAIM_IDLE_MS / 1000 * 0.8
            assert (text, n, finish) == (await reference(c, [prompt], 6))[0]
            assert r.xpending(streams.render_stream(), streams.RENDER_GROUP)["pending"] == 0
            s.restart(holder)
            return
        pytest.fail("no renderer was blocked in XREADGROUP in 5 attempts")
    finally:
        r.close()


async def test_restarted_gateway_does_not_disturb_the_other(faults_stack):
    s = faults_stack
    rng = random.Random(random.getrandbits(64))
    prompts = [rand_prompt(rng) for _ in range(12)]
    c1 = client(s, "gateway-1")
    ref = await reference(c1, prompts, 40)
    c0 = client(s, "gateway-0")
    progress: dict[int, int] = {}
    doomed = [asyncio.create_task(stream_completion(c0, p, 40)) for p in prompts[:4]]
    survivors = [
        asyncio.create_task(stream_completion(c1, p, 40, progress, i))
        for i, p in enumerate(prompts)
    ]
    while len(progress) < 4:
        await asyncio.sleep(0.002)
    s.kill("gateway-0")
    s.restart("gateway-0")
    assert await asyncio.gather(*survivors) == ref
    # The killed gateway's own clients lose their connection (or had finished): no hang.
    await asyncio.wait_for(asyncio.gather(*doomed, return_exceptions=True), 30)
    s.wait_ready()
    # The restarted gateway serves again, with the same results.
    assert await reference(client(s, "gateway-0"), prompts[:3], 40) == ref[:3]
