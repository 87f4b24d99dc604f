"""`voltserve scheduler`: admission, placement across executors, abort forwarding, failover.

One active leader holds a lease in Redis; standbys wait and take over. The leader's state
(admitted requests and where they run) is mirrored in a Redis hash so a new leader resumes it;
the tokens each request has streamed are re-learned by tailing the gateway output streams.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError
from voltserve.services.scheduler.admission import AdmissionQueue
from voltserve.services.scheduler.failover import (
    FAILED,
    PROGRESS,
    RequestTracker,
    Tracked,
    base_id,
    crash_loop_message,
    decode_progress,
    max_tokens_of,
)
from voltserve.services.scheduler.leader import LeaderLease
from voltserve.services.scheduler.placement import Placement
from voltserve.services.scheduler.registry import ExecutorInfo, ExecutorRegistry
from voltserve.shared import broker, metrics, startup, streams
from voltserve.shared.logging import add_log_level_flag, setup_logging
from voltserve.shared.protocol import (
    AbortRequest,
    EngineRequest,
    RequestDelta,
    RequestError,
    StepOutput,
)

logger = logging.getLogger(__name__)

SCHEDULER_ID = "scheduler"  # executor_id on StepOutputs the scheduler writes itself
ABORT_MEMORY_S = 120.0  # an abort that overtakes its request still applies this long
FINISHED_MEMORY = 100_000
# After a broker outage, heartbeats may be missing (a broker restarted without persistence, or
# keys that expired while it was away) until each executor and gateway beats again: none is
# declared gone before this much time has passed since the broker came back. It covers the
# gateway's beat interval (a third of its 10 s TTL) and a service's own probe backoff.
OUTAGE_GRACE_S = 10.0


@dataclass
class SchedulerConfig:
    redis_url: str
    max_queued_requests: int = 1024
    lease_ttl_s: float = 3.0
    registry_interval_s: float = 0.2
    executor_queue_factor: float = 2.0
    scheduler_id: str = ""
    redis_outage_timeout_s: float = broker.DEFAULT_OUTAGE_TIMEOUT_S


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics.SchedulerMetrics(registry or CollectorRegistry())
        self.token = cfg.scheduler_id or f"sched-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stop = asyncio.Event()
        self.is_leader = False
        self._reset()

    def _reset(self) -> None:
        self.tracker = RequestTracker()
        self.queue = AdmissionQueue(self.cfg.max_queued_requests)
        self.placement = Placement(self.cfg.executor_queue_factor)
        self.registry: ExecutorRegistry | None = None
        self.aborted: dict[str, float] = {}
        # Recently finished ids: a redelivered EngineRequest (its first handler died before the
        # ack) must not run twice.
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.gateways_alive: set[str] = set()
        self.gw_positions: dict[str, str] = {}
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()
        # Requests admitted from the batch being handled whose route records are not written
        # yet (_after_batch writes them, before the batch is acknowledged).
        self.unrecorded: list[Tracked] = []
        # request_id -> how many output tokens its last placement carried: a request still at
        # that count after a broker outage may have lost its message to the executor.
        self.placed_at: dict[str, int] = {}
        self.grace_until = 0.0  # no heartbeat counts as expired before this (monotonic)

    # ---- lifecycle ----

    async def run(self) -> None:
        r = streams.connect(self.cfg.redis_url, outage_timeout_s=self.cfg.redis_outage_timeout_s)
        lease = LeaderLease(r, self.token, self.cfg.lease_ttl_s)
        try:
            while not self.stop.is_set():
                if not await lease.acquire(self.stop):
                    break
                logger.info("scheduler %s is the leader", self.token)
                self.is_leader = True
                try:
                    await self._lead(r, lease)
                finally:
                    self.is_leader = False
        finally:
            await lease.release()
            await r.aclose()

    async def _lead(self, r, lease: LeaderLease) -> None:
        self._reset()
        self.r = r
        self.registry = ExecutorRegistry(r)
        await self.registry.refresh()
        await self._restore()
        tasks = [
            asyncio.create_task(lease.keep(), name="lease"),
            asyncio.create_task(
                streams.consume(
                    r,
                    streams.sched_stream(),
                    streams.SCHED_GROUP,
                    self.token,
                    self._handle,
                    after_batch=self._after_batch,
                ),
                name="consume",
            ),
            asyncio.create_task(self._registry_loop(), name="registry"),
            asyncio.create_task(self._tail_loop(), name="tail"),
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
        ]
        stop_wait = asyncio.create_task(self.stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop_wait and t.get_name() != "lease" and t.exception():
                    logger.error("scheduler task %s crashed", t.get_name(), exc_info=t.exception())
        finally:
            for t in [*tasks, stop_wait]:
                t.cancel()
            # Bounded: a cancellation swallowed inside a Redis call must not hang the step-down.
            await asyncio.wait([*tasks, stop_wait], timeout=3)

    async def _restore(self) -> None:
        """Resume a previous leader's requests from the routes hash."""
        raw = await self.r.hgetall(streams.scheduler_routes_key())
        orphans: list[Tracked] = []
        for _, data in sorted(raw.items()):
            try:
                t = Tracked.from_record(data)
            except Exception:  # noqa: BLE001 - a broken record must not stop the takeover
                logger.exception("dropping unreadable route record")
                continue
            self.tracker.restore(t)
            alive = self.registry.alive.get(t.executor_id)
            if not t.executor_id:
                self.queue.push(t.req)
            elif alive is None or alive.instance != t.instance:
                orphans.append(t)
        if raw:
            logger.warning("resumed %d unfinished request(s) from the previous leader", len(raw))
        # The tail starts at the beginning of each stream, so restored requests re-learn tokens.
        for gw in self.tracker.gateways():
            self.gw_positions.setdefault(streams.gw_stream(gw), "0")
        for t in orphans:
            await self._resend(t)
        self.wake.set()

    # ---- vs:sched ----

    async def _handle(self, msg_id: bytes, msg: Any) -> None:
        if isinstance(msg, EngineRequest):
            await self._admit(msg)
        elif isinstance(msg, AbortRequest):
            await self._abort(msg)
        else:
            logger.error("unexpected %s on %s", type(msg).__name__, streams.sched_stream())

    def _was_aborted(self, request_id: str) -> bool:
        return request_id in self.aborted or base_id(request_id) in self.aborted

    async def _admit(self, req: EngineRequest) -> None:
        if req.request_id in self.tracker or req.request_id in self.finished:
            return  # redelivered
        if self._was_aborted(req.request_id):
            logger.info("dropping %s: aborted before it arrived", req.request_id)
            return
        if self.queue.full():
            n = self.cfg.max_queued_requests
            err = RequestError(
                req.request_id,
                503,
                f"server overloaded: {len(self.queue)} requests are already waiting for an "
                f"executor (--max-queued-requests={n}); retry later",
                type="service_unavailable",
            )
            await streams.xadd(
                self.r, streams.gw_stream(req.gateway_id), err, maxlen=streams.OUTPUT_MAXLEN
            )
            return
        t = self.tracker.add(req)
        # A new stream is read from its start (bounded by MAXLEN), so no delta is missed.
        self.gw_positions.setdefault(streams.gw_stream(req.gateway_id), "0")
        self.queue.push(req)
        self.unrecorded.append(t)

    async def _after_batch(self) -> None:
        """After a batch of vs:sched messages, before its XACK: place what can be placed (the
        placements write their route records), then record the rest, so every admitted
        request is durable before its message is acknowledged. A burst costs two round trips
        per batch instead of two per request (a 256-request burst used to reach the executor
        one request at a time)."""
        if not self.unrecorded:
            return
        await self._dispatch()
        pending, self.unrecorded = self.unrecorded, []
        # Still queued (no executor had room) and not ended meanwhile (an abort in the same
        # batch finished it and deleted its record).
        queued = [t for t in pending if not t.executor_id and t.req.request_id in self.tracker]
        if queued:
            try:
                async with self.r.pipeline(transaction=False) as p:
                    for t in queued:
                        p.hset(streams.scheduler_routes_key(), t.req.request_id, t.to_record())
                    await p.execute()
            except BaseException:
                # Not acknowledged: the batch comes back, finds its requests tracked, and the
                # next batch's call records them.
                self.unrecorded = queued + self.unrecorded
                raise

    async def _abort(self, msg: AbortRequest) -> None:
        now = time.monotonic()
        by_executor: dict[str, list[str]] = {}
        for a in msg.request_ids:
            self.aborted[a] = now
            for rid in self.tracker.match(a):
                t = self.tracker.requests[rid]
                if t.executor_id:
                    t.aborted = True
                    by_executor.setdefault(t.executor_id, []).append(rid)
                else:
                    self.queue.remove(rid)
                    await self._finish_here(t, "abort")
        for eid, ids in by_executor.items():
            await streams.xadd(self.r, streams.exec_stream(eid), AbortRequest(ids, msg.reason))

    async def _finish_here(self, t: Tracked, reason: str) -> None:
        """End a request the scheduler holds itself (queued, aborted, or out of budget)."""
        rid = t.req.request_id
        self.tracker.finish(rid)
        self._remember_finished(rid)
        delta = RequestDelta(rid, [], len(t.tokens), finish_reason=reason)
        async with self.r.pipeline(transaction=False) as p:
            await streams.xadd(
                p,
                streams.gw_stream(t.req.gateway_id),
                StepOutput(SCHEDULER_ID, 0, [delta]),
                maxlen=streams.OUTPUT_MAXLEN,
            )
            p.hdel(streams.scheduler_routes_key(), rid)
            await p.execute()

    def _remember_finished(self, request_id: str) -> None:
        self.finished[request_id] = None
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)

    # ---- placement ----

    async def _dispatch_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self._dispatch()

    async def _dispatch(self) -> None:
        async with self.lock:
            executors = list(self.registry.alive.values())
            load = self.tracker.load()
            placed: list[tuple[Tracked, str]] = []
            # Suspects (failover.py: the crash-loop guard) go one per executor; one that has to
            # wait for such an executor lets the requests behind it pass.
            holding: set[str] | None = None
            held_back: list[EngineRequest] = []
            while len(self.queue):
                req = self.queue.peek()
                t = self.tracker.requests.get(req.request_id)
                if t is None:  # finished while queued
                    self.queue.pop()
                    continue
                pool = executors
                if t.suspect:
                    if holding is None:
                        holding = self.tracker.suspect_executors()
                    pool = [e for e in executors if e.executor_id not in holding]
                eid = self.placement.choose(req.prompt_token_ids, pool, load)
                if eid is None:
                    if pool is executors:
                        break
                    held_back.append(self.queue.pop())
                    continue
                self.queue.pop()
                t.executor_id, t.instance = eid, self.registry.alive[eid].instance
                load[eid] = load.get(eid, 0) + 1
                placed.append((t, eid))
                self.placed_at[req.request_id] = len(t.tokens)
                if t.suspect and holding is not None:
                    holding.add(eid)
            for req in reversed(held_back):
                self.queue.push_front(req)
            if not placed:
                return
            if len(self.placed_at) > 2 * len(self.tracker.requests) + 1024:
                self.placed_at = {
                    k: v for k, v in self.placed_at.items() if k in self.tracker.requests
                }
            # Every placement of this pass in one round trip (a burst of arrivals is placed
            # together instead of one request per round trip).
            async with self.r.pipeline(transaction=False) as p:
                for t, eid in placed:
                    p.hset(streams.scheduler_routes_key(), t.req.request_id, t.to_record())
                    await streams.xadd(p, streams.exec_stream(eid), self.tracker.resend_request(t))
                await p.execute()
            for t, eid in placed:
                logger.debug("placed %s on %s", t.req.request_id, eid)

    # ---- heartbeats and failover ----

    async def _registry_loop(self) -> None:
        next_gateway_check = 0.0
        link = broker.link_of(self.r)
        epoch = link.epoch if link is not None else 0
        while True:
            await asyncio.sleep(self.cfg.registry_interval_s)
            try:
                appeared, gone = await self.registry.refresh()
                if link is not None and link.epoch != epoch:
                    epoch = link.epoch
                    self.grace_until = time.monotonic() + OUTAGE_GRACE_S
                    await self._after_outage()
                if time.monotonic() < self.grace_until:
                    gone = self._hold_missing(gone)
                for e in gone:
                    await self._failover(e)
                if appeared or gone:
                    self.wake.set()
                if time.monotonic() >= max(next_gateway_check, self.grace_until):
                    next_gateway_check = time.monotonic() + 1.0
                    await self._check_gateways()
            except RedisError as e:
                # A Redis hiccup must not cost the leadership (and a state rebuild): retry.
                logger.error("registry refresh failed: %r; retrying", e)
            now = time.monotonic()
            for a in [a for a, ts in self.aborted.items() if now - ts > ABORT_MEMORY_S]:
                del self.aborted[a]

    def _hold_missing(self, gone: list[ExecutorInfo]) -> list[ExecutorInfo]:
        """During the grace after an outage: an executor whose heartbeat is merely missing stays
        registered (it is asked again next round); one that came back as a new process is
        gone for real."""
        assert self.registry is not None
        real = []
        for e in gone:
            if e.executor_id in self.registry.alive:
                real.append(e)  # replaced by a new instance
            else:
                self.registry.alive[e.executor_id] = e
        return real

    async def _after_outage(self) -> None:
        """The broker is back and may have lost what it held (everything without persistence,
        its last second of writes with it). Rewrite the routes hash from memory, and send each
        placed request that has streamed nothing since its placement to its executor again: an
        executor that has it recognises the (request, offset) and ignores it, one whose message
        was lost runs it."""
        async with self.lock:
            tracked = list(self.tracker.requests.values())
            resend = [
                t
                for t in tracked
                if t.executor_id and self.placed_at.get(t.req.request_id) == len(t.tokens)
            ]
            async with self.r.pipeline(transaction=True) as p:
                p.delete(streams.scheduler_routes_key())
                for t in tracked:
                    p.hset(streams.scheduler_routes_key(), t.req.request_id, t.to_record())
                for t in resend:
                    msg = self.tracker.resend_request(t)
                    await streams.xadd(p, streams.exec_stream(t.executor_id), msg)
                await p.execute()
        logger.warning(
            "after the broker outage: rewrote %d route(s), re-sent %d request(s) that had not "
            "started streaming",
            len(tracked),
            len(resend),
        )

    async def _check_gateways(self) -> None:
        """Abort the requests of a gateway whose heartbeat expired: nobody reads their output,
        so they would only hold KV blocks. (A gateway never seen beating is left alone.)"""
        for g in self.tracker.gateways():
            if await self.r.exists(streams.gateway_alive_key(g)):
                self.gateways_alive.add(g)
            elif g in self.gateways_alive:
                self.gateways_alive.discard(g)
                ids = [t.req.request_id for t in self.tracker.requests.values()]
                ids = [i for i in ids if self.tracker.requests[i].req.gateway_id == g]
                logger.warning("gateway %s is gone; aborting its %d request(s)", g, len(ids))
                await self._abort(AbortRequest(ids, reason="gateway_gone"))

    async def _failover(self, e: ExecutorInfo) -> None:
        moved = self.tracker.on_executor(e.executor_id, e.instance)
        self.placement.forget(e.executor_id)
        replaced = e.executor_id in self.registry.alive
        if not replaced:
            # Its queue would only replay work that now runs elsewhere.
            await self.r.delete(streams.exec_stream(e.executor_id))
            await self.r.srem(streams.executors_key(), e.executor_id)
        if not moved:
            return
        logger.warning(
            "failing over %d request(s) of executor %s (instance %s)",
            len(moved),
            e.executor_id,
            e.instance,
        )
        # In case it was only stalled: it must drop them silently when it wakes up.
        await streams.xadd(
            self.r,
            streams.exec_stream(e.executor_id),
            AbortRequest([t.req.request_id for t in moved], reason="failover"),
        )
        for t in reversed(moved):  # push_front: keep their original order
            await self._resend(t)

    async def _resend(self, t: Tracked) -> None:
        """t was in flight on an executor that died: place it again, unless that would repeat a
        crash loop (failover.py)."""
        t.executor_id, t.instance = "", ""
        budget = max_tokens_of(t.req)
        crash_loop = self.tracker.on_death(t)
        if t.aborted:
            await self._finish_here(t, "abort")
        elif budget is not None and len(t.tokens) >= budget:
            await self._finish_here(t, "length")
        elif crash_loop:
            await self._fail_crash_loop(t)
        else:
            await self.r.hset(streams.scheduler_routes_key(), t.req.request_id, t.to_record())
            self.queue.push_front(t.req)
        self.wake.set()

    async def _fail_crash_loop(self, t: Tracked) -> None:
        rid = t.req.request_id
        logger.error(
            "request %s was in flight at %d executor deaths in a row with no output in between: "
            "failing it instead of placing it again",
            rid,
            t.deaths,
        )
        self.tracker.finish(rid)
        self._remember_finished(rid)
        self.metrics.crash_loop_failed.inc()
        err = RequestError(rid, 500, crash_loop_message(t.deaths), type="internal_server_error")
        async with self.r.pipeline(transaction=False) as p:
            await streams.xadd(
                p, streams.gw_stream(t.req.gateway_id), err, maxlen=streams.OUTPUT_MAXLEN
            )
            p.hdel(streams.scheduler_routes_key(), rid)
            await p.execute()

    # ---- tailing the gateway output streams ----

    async def _tail_loop(self) -> None:
        # Blocking reads get their own connection pool.
        tail_r = streams.connect(
            self.cfg.redis_url, outage_timeout_s=self.cfg.redis_outage_timeout_s
        )
        next_discover = 0.0
        try:
            while True:
                if time.monotonic() >= next_discover:
                    next_discover = time.monotonic() + 1.0
                    for g in await self.r.smembers(streams.gateways_key()):
                        self.gw_positions.setdefault(streams.gw_stream(g.decode()), "0")
                try:
                    entries = await streams.tail(
                        tail_r,
                        self.gw_positions,
                        count=1024,
                        block_ms=200,
                        decoder=decode_progress,
                    )
                except RedisError as e:
                    logger.error("tailing the gateway streams failed: %r; retrying", e)
                    await asyncio.sleep(0.5)
                    continue
                finished = []
                on_progress = self.tracker.on_progress
                for _, _, msg in entries:
                    if msg is None:
                        continue
                    kind, body = msg
                    if kind == PROGRESS:
                        for rid, offset, token_ids, finish in body:
                            if on_progress(rid, offset, token_ids, finish):
                                finished.append(rid)
                    elif kind == FAILED:
                        finished.append(body)
                if finished:
                    async with self.r.pipeline(transaction=False) as p:
                        for rid in finished:
                            if self.tracker.finish(rid) is not None:
                                p.hdel(streams.scheduler_routes_key(), rid)
                                self._remember_finished(rid)
                        await p.execute()
                    self.wake.set()
                if self.tracker.take_suspect_cleared():
                    self.wake.set()  # an executor may take the next suspect
        finally:
            await tail_r.aclose()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voltserve scheduler", description=__doc__)
    broker.add_broker_flags(p)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for an executor beyond this are refused with 503",
    )
    p.add_argument("--lease-ttl", type=float, default=3.0, help="leader lease, seconds")
    p.add_argument("--registry-interval", type=float, default=0.2, help="heartbeat scan, seconds")
    p.add_argument(
        "--executor-queue-factor",
        type=float,
        default=2.0,
        help="an executor gets at most this many times its max-num-seqs unfinished requests",
    )
    p.add_argument("--scheduler-id", default="")
    metrics.add_metrics_port_flag(p)
    add_log_level_flag(p)
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    setup_logging("scheduler", args.log_level, args.log_json)
    registry = metrics.serve_process_metrics(args.metrics_port)
    sched = Scheduler(
        SchedulerConfig(
            redis_url=args.redis_url,
            max_queued_requests=args.max_queued_requests,
            lease_ttl_s=args.lease_ttl,
            registry_interval_s=args.registry_interval,
            executor_queue_factor=args.executor_queue_factor,
            scheduler_id=args.scheduler_id,
            redis_outage_timeout_s=args.redis_outage_timeout,
        ),
        registry,
    )

    startup.freeze_heap()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, sched.stop.set)
        await sched.run()

    asyncio.run(run())
