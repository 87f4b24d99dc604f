"""The scheduler's gateway-gone path against a real valkey server: when a gateway that was seen
beating stops (its heartbeat key expires), the scheduler aborts that gateway's requests, since
nobody reads their output: those on an executor get an AbortRequest on the executor's stream
(reason "gateway_gone"), queued ones end at the scheduler. Other gateways' requests and a
gateway never seen beating are left alone. The scheduler's check is called directly, so the
outcome does not depend on heartbeat timing."""

from __future__ import annotations

import redis
from voltserve.services.scheduler.main import Scheduler, SchedulerConfig
from voltserve.shared import streams
from voltserve.shared.protocol import AbortRequest, EngineRequest, StepOutput


def _request(rid: str, gateway: str) -> EngineRequest:
    return EngineRequest(rid, gateway, [5, 6, 7], {"max_tokens": 4, "seed": 1})


def _messages(r: redis.Redis, stream: str) -> list:
    return [streams.decode_fields(fields) for _, fields in r.xrange(stream)]


async def test_a_vanished_gateways_requests_are_aborted(redis_url: str) -> None:
    sched = Scheduler(SchedulerConfig(redis_url=redis_url))
    sched.r = streams.connect(redis_url)
    sync = redis.Redis.from_url(redis_url)
    try:
        on_executor = {"gw-gone": ["gone-0", "gone-1"], "gw-live": ["live-0"], "gw-new": ["new-0"]}
        for gw, ids in on_executor.items():
            for rid in ids:
                sched.tracker.add(_request(rid, gw)).executor_id = "exec-0"
        queued = sched.tracker.add(_request("gone-queued", "gw-gone"))
        sched.queue.push(queued.req)
        for gw in ("gw-gone", "gw-live"):  # gw-new never beats
            sync.set(streams.gateway_alive_key(gw), 1)

        await sched._check_gateways()  # every gateway seen: nothing to do
        assert not _messages(sync, streams.exec_stream("exec-0"))
        assert sched.gateways_alive == {"gw-gone", "gw-live"}

        sync.delete(streams.gateway_alive_key("gw-gone"))
        await sched._check_gateways()
        (abort,) = _messages(sync, streams.exec_stream("exec-0"))
        assert isinstance(abort, AbortRequest)
        assert sorted(abort.request_ids) == ["gone-0", "gone-1"]
        assert abort.reason == "gateway_gone"
        # The queued one ends here: a finish delta to its (gone) gateway, out of the queue.
        (out,) = _messages(sync, streams.gw_stream("gw-gone"))
        assert isinstance(out, StepOutput)
        assert [(d.request_id, d.finish_reason) for d in out.deltas] == [("gone-queued", "abort")]
        assert "gone-queued" not in sched.tracker and sched.queue.remove("gone-queued") is None
        assert all(rid in sched.tracker for rid in ("live-0", "new-0", "gone-0", "gone-1"))
        assert sched.gateways_alive == {"gw-live"}

        await sched._check_gateways()  # reported once, not again on every check
        assert len(_messages(sync, streams.exec_stream("exec-0"))) == 1
    finally:
        await sched.r.aclose()
        sync.close()
