"""The gateway through a message broker outage.

While the broker is away, new generation requests get a 503 that names it, and `/health` says
so; requests in flight wait (their streams pause) and carry on once it is back, since every
service keeps its state and rides out the outage (shared/broker.py).

A broker that comes back may have lost messages: all it held when it ran without persistence,
its last second of writes with an append-only file. A request whose message was lost would wait
forever, so `LostRequestWatch` follows every request that was in flight across the outage: one
that receives nothing afterwards and that the scheduler does not track either (its routes hash,
which the scheduler rewrites from memory after an outage) for LOST_AFTER_S ends with a clear
503. A request that streams again, or finishes, is no longer followed. (Output lost in the
middle of a stream shows up as a gap in its offsets: the dispatcher ends that one.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.services.gateway.errors import APIError
from voltserve.shared import broker, streams
from voltserve.shared.protocol import RequestError

logger = logging.getLogger(__name__)

LOST_AFTER_S = 10.0
CHECK_INTERVAL_S = 2.0
LOST_MESSAGE = (
    "this request was lost when the message broker restarted without its messages "
    "(no persistence, or its last second of writes); retry it"
)


def unavailable(redis: Any, err: Exception | None = None) -> APIError:
    """The 503 of a request that needs the broker while it is away."""
    link = broker.link_of(redis)
    msg = link.unavailable_message() if link is not None else f"the message broker failed: {err}"
    return APIError(503, msg, type="service_unavailable")


def check_broker(redis: Any) -> None:
    """Raise the 503 now when the broker is known to be away (a new request would only wait)."""
    link = broker.link_of(redis)
    if link is not None and link.down:
        raise unavailable(redis)


@dataclass
class _Followed:
    events: int  # the handle's event count when last seen
    untracked_since: float | None = None


class LostRequestWatch:
    def __init__(
        self,
        redis: Any,
        dispatcher: OutputDispatcher,
        lost_after_s: float = LOST_AFTER_S,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.redis = redis
        self.dispatcher = dispatcher
        self.lost_after_s = lost_after_s
        self.interval_s = interval_s
        self.followed: dict[str, _Followed] = {}

    async def run(self, stop: asyncio.Event) -> None:
        link = broker.link_of(self.redis)
        if link is None:
            return
        epoch = link.epoch
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                return
            except TimeoutError:
                pass
            if link.epoch != epoch:
                epoch = link.epoch
                for rid, h in self.dispatcher.handles.items():
                    self.followed[rid] = _Followed(h.events)
            if self.followed and not link.down:
                try:
                    with broker.fail_fast():
                        await self.check()
                except broker.BrokerUnavailable:
                    pass  # away again: the next round asks

    async def check(self) -> None:
        now = time.monotonic()
        quiet = []
        for rid, f in list(self.followed.items()):
            h = self.dispatcher.handles.get(rid)
            if h is None or h.events != f.events:
                del self.followed[rid]  # finished, or streaming again
            else:
                quiet.append((rid, h, f))
        if not quiet:
            return
        ids = [h.engine_id(i) for _, h, _ in quiet for i in range(h.n)]
        tracked = await self.redis.hmget(streams.scheduler_routes_key(), ids)
        k = 0
        for rid, h, f in quiet:
            known = any(v is not None for v in tracked[k : k + h.n])
            k += h.n
            if known:
                f.untracked_since = None
            elif f.untracked_since is None:
                f.untracked_since = now
            elif now - f.untracked_since >= self.lost_after_s:
                del self.followed[rid]
                logger.error("request %s was lost in the broker outage; ending it", rid)
                err = RequestError(rid, 503, LOST_MESSAGE, type="service_unavailable")
                self.dispatcher.dispatch(err)
