"""Reads this gateway's output stream (plain XREAD) and hands each request's deltas to the HTTP
handler waiting for it. Repeats (redelivery, failover) are dropped by output offset; a gap (output
the broker lost in a restart, or history trimmed before it was read) ends the request with an
error instead of streaming text with a hole in it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from voltserve.shared import streams
from voltserve.shared.protocol import RequestDelta, RequestError, StepOutput

logger = logging.getLogger(__name__)

# next_offset of a choice that a gap ended.
ENDED = 1 << 62


@dataclass(slots=True)
class Event:
    index: int  # choice index
    delta: RequestDelta | None = None
    error: RequestError | None = None
    executor_id: str = ""


@dataclass
class Handle:
    """One HTTP request: n engine requests "{request_id}.{i}" feeding one queue."""

    request_id: str
    n: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Next expected output position of each choice.
    next_offset: list[int] = field(default_factory=list)
    # Deltas and errors received (broker_outage.LostRequestWatch: is it still moving?).
    events: int = 0

    def __post_init__(self) -> None:
        self.next_offset = [0] * self.n

    def engine_id(self, i: int) -> str:
        return f"{self.request_id}.{i}"


class OutputDispatcher:
    def __init__(self, redis: Any, gateway_id: str) -> None:
        self.redis = redis
        self.stream = streams.gw_stream(gateway_id)
        self.handles: dict[str, Handle] = {}
        # "{request_id}.{i}" -> (handle, i): one dict lookup per delta on the hot path.
        self.choices: dict[str, tuple[Handle, int]] = {}
        self.last_id: str | None = None

    def register(self, request_id: str, n: int) -> Handle:
        h = Handle(request_id, n)
        self.handles[request_id] = h
        for i in range(n):
            self.choices[h.engine_id(i)] = (h, i)
        return h

    def unregister(self, request_id: str) -> None:
        h = self.handles.pop(request_id, None)
        if h is not None:
            for i in range(h.n):
                self.choices.pop(h.engine_id(i), None)

    async def start_position(self) -> None:
        """Start after the newest entry: older ones belong to an earlier gateway run."""
        last = await self.redis.xrevrange(self.stream, count=1)
        self.last_id = last[0][0].decode() if last else "0-0"

    async def run(self, stop: asyncio.Event) -> None:
        if self.last_id is None:
            await self.start_position()
        cursor = {self.stream: self.last_id}
        while not stop.is_set():
            try:
                # A large COUNT: a gateway that fell behind catches up in few round trips.
                entries = await streams.tail(self.redis, cursor, count=1024, block_ms=200)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep reading through Redis hiccups
                logger.error("reading %s failed: %s; retrying", self.stream, e)
                await asyncio.sleep(0.5)
                continue
            for _, _, msg in entries:
                self.dispatch(msg)

    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, StepOutput):
            delta, eid = self._delta, msg.executor_id
            for d in msg.deltas:
                delta(d, eid)
        elif isinstance(msg, RequestError):
            self._error(msg)

    def _lookup(self, engine_id: str) -> tuple[Handle, int] | None:
        return self.choices.get(engine_id)

    def _delta(self, d: RequestDelta, executor_id: str) -> None:
        found = self._lookup(d.request_id)
        if found is None:
            return
        h, i = found
        h.events += 1
        if h.next_offset[i] >= ENDED:
            return  # ended by a gap: nothing more of it goes to the client
        skip = h.next_offset[i] - d.output_offset
        if skip > 0:
            # Tokens we already have (a repeat after redelivery or failover).
            if skip >= len(d.token_ids) and d.finish_reason is None:
                return
            d.token_ids = d.token_ids[skip:]
            if d.logprobs is not None:
                d.logprobs = d.logprobs[skip:]
        elif skip < 0:
            lost = f"{h.next_offset[i]} to {d.output_offset - 1}"
            logger.error("output tokens %s of %s were lost; ending it", lost, d.request_id)
            msg = (
                f"output tokens {lost} of this request were lost (a message broker restart "
                "without them, or output trimmed before it was read); retry the request"
            )
            h.next_offset[i] = ENDED
            err = RequestError(d.request_id, 503, msg, type="service_unavailable")
            h.queue.put_nowait(Event(i, error=err))
            return
        h.next_offset[i] = max(h.next_offset[i], d.output_offset + len(d.token_ids) + max(skip, 0))
        h.queue.put_nowait(Event(i, delta=d, executor_id=executor_id))

    def _error(self, e: RequestError) -> None:
        found = self._lookup(e.request_id)
        if found is not None:
            found[0].events += 1
            found[0].queue.put_nowait(Event(found[1], error=e))
            return
        h = self.handles.get(e.request_id)
        if h is not None:  # an error for the whole request (the renderer's)
            h.events += 1
            h.queue.put_nowait(Event(-1, error=e))
