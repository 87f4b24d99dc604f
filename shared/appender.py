"""Appends protocol messages to streams from many coroutines, one pipelined round trip per batch.

A burst of N requests arriving at a gateway would otherwise cost N round trips, each on its own
pooled connection (the pool opens a new TCP connection per concurrent command): measured on the
CPU stack, that was most of the gateway's time under a 256-request burst. Callers await their own
append as before; messages queued while a batch is in flight go out together in the next one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from voltserve.shared.protocol import encode
from voltserve.shared.streams import PAYLOAD, WORK_MAXLEN


class StreamAppender:
    def __init__(self, redis: Any, max_batch: int = 512) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._queue: deque[tuple[str, bytes, int, asyncio.Future]] = deque()
        self._task: asyncio.Task | None = None

    async def xadd(self, stream: str, msg: Any, maxlen: int = WORK_MAXLEN) -> Any:
        """Append msg (trimming with MAXLEN ~); returns the entry id. Encoding errors
        (OverflowError, ValueError) raise here, before anything is queued."""
        return await self.xadd_encoded(stream, encode(msg), maxlen)

    async def xadd_encoded(self, stream: str, payload: bytes, maxlen: int = WORK_MAXLEN) -> Any:
        """xadd of a message already encoded (a caller that looked at its size first)."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((stream, payload, maxlen, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        # Runs while anything is queued; a caller that finds it finished starts a new one.
        while self._queue:
            n = min(len(self._queue), self.max_batch)
            batch = [self._queue.popleft() for _ in range(n)]
            try:
                async with self.redis.pipeline(transaction=False) as p:
                    for stream, payload, maxlen, _ in batch:
                        p.xadd(stream, {PAYLOAD: payload}, maxlen=maxlen, approximate=True)
                    results = await p.execute(raise_on_error=False)
            except asyncio.CancelledError:  # shutdown: nobody waits forever
                for *_, fut in batch:
                    fut.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
                results = [e] * len(batch)
            for (*_, fut), res in zip(batch, results, strict=True):
                if fut.done():  # the caller was cancelled (client went away)
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
