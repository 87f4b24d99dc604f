"""shared/streams.py against a real valkey server: ack, reclaim of a dead consumer's messages,
poison messages, trimming, tailing."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import pytest
from voltserve.shared import streams
from voltserve.shared.protocol import AbortRequest, EngineRequest, RequestDelta, StepOutput


def rand_request() -> EngineRequest:
    return EngineRequest(
        request_id=uuid.uuid4().hex,
        gateway_id="gw",
        prompt_token_ids=[random.randrange(1000) for _ in range(random.randrange(1, 40))],
        sampling={"max_tokens": random.randrange(1, 64), "seed": random.randrange(2**31)},
    )


async def run_consumer(r, stream, group, consumer, handler, **kw):
    stop = asyncio.Event()
    task = asyncio.create_task(
        streams.consume(r, stream, group, consumer, handler, stop=stop, block_ms=50, **kw)
    )
    return stop, task


async def wait_for(cond, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def pending(r, stream, group) -> int:
    return (await r.xpending(stream, group))["pending"]


async def test_handles_in_order_and_acks(redis_url):
    r = streams.connect(redis_url)
    stream, group = f"t:{uuid.uuid4().hex}", "g"
    sent = [rand_request() for _ in range(random.randrange(5, 30))]
    for m in sent:
        await streams.xadd(r, stream, m)
    got = []

    async def handler(msg_id, msg):
        got.append(msg)

    stop, task = await run_consumer(r, stream, group, "c1", handler)
    await wait_for(lambda: len(got) == len(sent))
    stop.set()
    await task
    assert got == sent
    assert await pending(r, stream, group) == 0
    # The group exists already: ensure_group is idempotent.
    await streams.ensure_group(r, stream, group)
    await r.aclose()


async def test_dead_consumer_messages_are_reclaimed(redis_url):
    r = streams.connect(redis_url)
    stream, group = f"t:{uuid.uuid4().hex}", "g"
    await streams.ensure_group(r, stream, group)
    sent = [rand_request() for _ in range(5)]
    for m in sent:
        await streams.xadd(r, stream, m)
    # A consumer reads everything and dies before acking.
    resp = await r.xreadgroup(group, "dead", {stream: ">"}, count=100)
    assert len(resp[0][1]) == len(sent)
    assert await pending(r, stream, group) == len(sent)
    got = []

    async def handler(msg_id, msg):
        got.append(msg)

    stop, task = await run_consumer(
        r, stream, group, "alive", handler, claim_idle_ms=300, claim_interval_s=0.1
    )
    await asyncio.sleep(0.15)
    assert got == []  # not idle long enough yet
    await wait_for(lambda: len(got) == len(sent))
    stop.set()
    await task
    assert sorted(m.request_id for m in got) == sorted(m.request_id for m in sent)
    assert await pending(r, stream, group) == 0
    await r.aclose()


async def test_own_pending_messages_are_rehandled_on_restart(redis_url):
    r = streams.connect(redis_url)
    stream, group = f"t:{uuid.uuid4().hex}", "g"
    await streams.ensure_group(r, stream, group)
    m = rand_request()
    await streams.xadd(r, stream, m)
    await r.xreadgroup(group, "same-name", {stream: ">"})
    got = []

    async def handler(msg_id, msg):
        got.append(msg)

    # Long claim timeout: only the restart path can find the message.
    stop, task = await run_consumer(r, stream, group, "same-name", handler, claim_idle_ms=60_000)
    await wait_for(lambda: got == [m])
    stop.set()
    await task
    assert await pending(r, stream, group) == 0
    await r.aclose()


async def test_poison_and_malformed_messages_are_acked_not_looped(redis_url, caplog):
    r = streams.connect(redis_url)
    stream, group = f"t:{uuid.uuid4().hex}", "g"
    poison = rand_request()
    good = rand_request()
    await streams.xadd(r, stream, poison)
    await r.xadd(stream, {b"d": b"\xc1 not msgpack"})
    await r.xadd(stream, {b"other": b"field"})
    await streams.xadd(r, stream, good)
    calls: list[str] = []

    async def handler(msg_id, msg):
        calls.append(msg.request_id)
        if msg.request_id == poison.request_id:
            raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="voltserve.shared.streams"):
        stop, task = await run_consumer(
            r, stream, group, "c", handler, claim_idle_ms=100, claim_interval_s=0.05
        )
        await wait_for(lambda: good.request_id in calls)
        await asyncio.sleep(0.4)  # several reclaim rounds: nothing may come back
        stop.set()
        await task
    assert calls == [poison.request_id, good.request_id]
    assert await pending(r, stream, group) == 0
    assert sum("dropping it" in rec.getMessage() for rec in caplog.records) == 3
    await r.aclose()


async def test_xadd_trims_approximately(redis_url):
    r = streams.connect(redis_url)
    stream = f"t:{uuid.uuid4().hex}"
    maxlen = random.choice([100, 200, 300])
    async with r.pipeline(transaction=False) as p:
        for _ in range(5000):
            await streams.xadd(p, stream, AbortRequest([uuid.uuid4().hex]), maxlen=maxlen)
        await p.execute()
    n = await r.xlen(stream)
    # "~" trims whole macro nodes (100 entries by default), never below maxlen.
    assert maxlen <= n <= maxlen + 100
    await r.aclose()


async def test_tail_follows_several_streams(redis_url):
    r = streams.connect(redis_url)
    a, b = f"t:{uuid.uuid4().hex}", f"t:{uuid.uuid4().hex}"
    msgs = {
        a: [StepOutput("e", i, [RequestDelta("x", [i], i)]) for i in range(7)],
        b: [StepOutput("e", i, [RequestDelta("y", [i, i], 2 * i)]) for i in range(4)],
    }
    for name, ms in msgs.items():
        for m in ms:
            await streams.xadd(r, name, m, maxlen=streams.OUTPUT_MAXLEN)
    positions = {a: "0", b: "0"}
    seen: dict[str, list] = {a: [], b: []}
    while sum(len(v) for v in seen.values()) < 11:
        for name, _, msg in await streams.tail(r, positions, count=3, block_ms=100):
            seen[name].append(msg)
    assert seen == msgs
    assert await streams.tail(r, positions, block_ms=50) == []
    await r.aclose()


@pytest.mark.parametrize("n", [0, 3])
async def test_heartbeat_expires(redis_url, n):
    r = streams.connect(redis_url)
    status = {"free": n, "model": "m"}
    await streams.set_heartbeat(r, "hb:x", "st:x", status, ttl_s=0.3)
    assert await r.exists("hb:x")
    assert await streams.read_status(r, "st:x") == {"free": str(n), "model": "m"}
    await asyncio.sleep(0.5)
    assert not await r.exists("hb:x")
    await r.aclose()


async def test_batch_handler_gets_each_read_in_order_and_a_failed_batch_comes_back(redis_url):
    """batch=True: the handler gets every decodable message of a read at once, in stream
    order (a malformed entry is dropped and logged); after_batch runs before the XACK; a batch
    whose handler raises stays pending and is handled again, whole, by the reclaim."""
    print("seed", seed := random.randrange(2**31))
    rng = random.Random(seed)
    r = streams.connect(redis_url)
    stream, group = f"t:{uuid.uuid4().hex}", "g"
    sent = [rand_request() for _ in range(rng.randrange(5, 60))]
    bad_at = rng.randrange(len(sent))
    for i, m in enumerate(sent):
        if i == bad_at:
            await r.xadd(stream, {b"d": b"\xc1 not msgpack"})
        await streams.xadd(r, stream, m)
    batches: list[list] = []
    acked_before: list[int] = []
    fail_once = [True]

    async def handler(items):
        if fail_once[0]:
            fail_once[0] = False
            raise ConnectionError("redis went away mid-batch")
        batches.append([msg for _, msg in items])

    async def after_batch():
        acked_before.append(await pending(r, stream, group))

    stop, task = await run_consumer(
        r,
        stream,
        group,
        "c1",
        handler,
        batch=True,
        after_batch=after_batch,
        count=64,
        claim_idle_ms=100,
        claim_interval_s=0.05,
    )
    await wait_for(lambda: sum(map(len, batches)) >= len(sent))
    stop.set()
    await task
    got = [m for b in batches for m in b]
    assert got == sent  # once each, in order, the failed batch included
    assert all(n > 0 for n in acked_before)  # after_batch ran while the batch was pending
    assert await pending(r, stream, group) == 0
    await r.aclose()


async def test_appender_batches_concurrent_appends(redis_url):
    """StreamAppender: many coroutines append at once; every message lands exactly once with
    the id its caller got back, across streams; a message msgpack cannot encode raises in its
    caller and sends nothing."""
    from voltserve.shared.appender import StreamAppender

    r = streams.connect(redis_url)
    app = StreamAppender(r, max_batch=32)
    names = [f"t:{uuid.uuid4().hex}" for _ in range(3)]
    sent = [(random.choice(names), rand_request()) for _ in range(random.randrange(50, 200))]
    ids = await asyncio.gather(*(app.xadd(s, m) for s, m in sent))
    assert len({(s, i) for (s, _), i in zip(sent, ids, strict=True)}) == len(sent)
    for name in names:
        entries = await r.xrange(name)
        want = {i: m for (s, m), i in zip(sent, ids, strict=True) if s == name}
        assert {e[0]: streams.decode_fields(e[1]) for e in entries} == want
    with pytest.raises((OverflowError, ValueError)):
        await app.xadd(names[0], EngineRequest("x", "gw", [1 << 70], {}))
    assert await r.xlen(names[0]) == len([1 for s, _ in sent if s == names[0]])
    await r.aclose()
