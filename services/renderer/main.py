"""`voltserve renderer`: a consumer of vs:render and vs:render:large (any number of replicas share
the groups).

The two queues are consumed side by side, each by its own loop and worker thread: a request on
vs:render (the gateway puts there those with a small payload and no grammar to build) never waits
for one on vs:render:large, which holds long prompts and grammar constraints and is taken one
request at a time. Each of those is bounded: a prompt that cannot fit is refused after at most
about max_model_len tokens of tokenization (render.Renderer.check_text_length), one that fits is
tokenized in full, and the tokenizer releases the GIL while it works.

The context length, eos ids and vocabulary are the executors' (shared/model_limits.py), read
from their status hashes; a batch that arrives before any executor published them waits."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Any

from voltserve.services.renderer.render import Renderer, RenderFailed, error_for
from voltserve.shared import broker, metrics, startup, streams
from voltserve.shared.logging import add_log_level_flag, setup_logging
from voltserve.shared.model_limits import PublishedLimits
from voltserve.shared.protocol import RenderRequest

logger = logging.getLogger(__name__)

# Requests rendered recently, so a redelivered RenderRequest is not sent to the scheduler twice.
DONE_TTL_S = 3600


def done_key(request_id: str) -> str:
    return f"vs:rendered:{request_id}"


class RendererService:
    def __init__(
        self,
        redis: Any,
        renderer: Renderer,
        stream: str | None = None,
        delete_handled: bool = False,
        limits: PublishedLimits | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.redis = redis
        self.renderer = renderer
        # The executors' published limits, followed into renderer.limits before each batch
        # (None: the renderer's own limits are used as they are, as tests set them).
        self.limits = limits
        self.stop = stop
        self.stream = stream or streams.render_stream()
        # Delete each entry once handled (the large queue: its payloads may be megabytes, and
        # the stream would otherwise keep them until trimmed).
        self.delete_handled = delete_handled
        # The batch being handled: (stream, message, maxlen) hand-offs and the ids they finish,
        # written by after_batch in one round trip, and the stream entries to delete.
        self.handoffs: list[tuple[str, Any, int]] = []
        self.rendered: list[str] = []
        self.entries: list[bytes] = []

    async def handle_batch(self, items: list[tuple[bytes, Any]]) -> None:
        """One read's requests: one round trip to skip redeliveries, then one worker thread
        renders them all in stream order. A request per round trip and per thread hop, 32 at a
        time, had the renderer's ~20 threads and its event loop trading the GIL for each of a
        burst's 256 requests (~0.5 ms a request on a 2-core CPU). Templates hold the GIL and so
        does a single `encode`; Renderer.render_many tokenizes the batch's texts in one call,
        which a fast tokenizer spreads over its own threads. The thread keeps the loop free."""
        reqs = []
        for _, msg in items:
            if isinstance(msg, RenderRequest):
                reqs.append(msg)
            else:
                logger.warning("unexpected %s on %s", type(msg).__name__, self.stream)
        if reqs:
            if self.limits is not None:
                # Until an executor has published, the batch waits (unacknowledged): the
                # gateway forwards nothing before it knows the limits, so this is only the
                # moment between its refresh and ours.
                self.renderer.limits = await self.limits.wait(self.stop)
            await self._render(reqs)
        if self.delete_handled:  # only once handled: a failure above leaves them for redelivery
            self.entries.extend(msg_id for msg_id, _ in items)

    async def _render(self, reqs: list[RenderRequest]) -> None:
        async with self.redis.pipeline(transaction=False) as p:
            for msg in reqs:
                p.exists(done_key(msg.request_id))
            seen = await p.execute()
        todo = [msg for msg, done in zip(reqs, seen, strict=True) if not done]
        for msg, out in zip(todo, await asyncio.to_thread(self._render_all, todo), strict=True):
            self.handoffs.extend(out)
            self.rendered.append(msg.request_id)

    def _render_all(self, reqs: list[RenderRequest]) -> list[list[tuple[str, Any, int]]]:
        return [
            self._handoffs(msg, out)
            for msg, out in zip(reqs, self.renderer.render_many(reqs), strict=True)
        ]

    def _handoffs(self, msg: RenderRequest, out: Any) -> list[tuple[str, Any, int]]:
        if not isinstance(out, Exception):
            return [(streams.sched_stream(), er, streams.WORK_MAXLEN) for er in out]
        e = out
        if not isinstance(e, RenderFailed):  # the client must get an answer, never a hang
            logger.error("rendering %s failed", msg.request_id, exc_info=e)
            e = RenderFailed(500, f"internal error while rendering: {type(e).__name__}: {e}")
        return [(streams.gw_stream(msg.gateway_id), error_for(msg, e), streams.OUTPUT_MAXLEN)]

    async def after_batch(self) -> None:
        """The batch's hand-offs and done marks in one round trip, before the batch is acked.
        The marks go after the appends: a crash between them redelivers the requests, which
        the scheduler recognises by their ids. Deleted entries go last: one redelivered after
        that comes back empty and is skipped, its hand-off made."""
        if not self.rendered and not self.entries:
            return
        handoffs, rendered, entries = self.handoffs, self.rendered, self.entries
        self.handoffs, self.rendered, self.entries = [], [], []
        async with self.redis.pipeline(transaction=False) as p:
            for stream, m, maxlen in handoffs:
                await streams.xadd(p, stream, m, maxlen=maxlen)
            for request_id in rendered:
                p.set(done_key(request_id), b"1", ex=DONE_TTL_S)
            if entries:
                p.xdel(self.stream, *entries)
            await p.execute()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="voltserve renderer", description=__doc__)
    broker.add_broker_flags(p)
    p.add_argument("--model", required=True, help="model folder (tokenizer and chat template)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--consumer-name", default=None, help="default: host-pid")
    metrics.add_metrics_port_flag(p)
    add_log_level_flag(p)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    # An unreadable tokenizer or config will not fix itself: exit with the fatal code.
    with startup.fatal_errors("renderer", also=(OSError,)):
        renderer = Renderer(args.model, tokenizer_path=args.tokenizer)
    redis = streams.connect(args.redis_url, outage_timeout_s=args.redis_outage_timeout)
    limits = PublishedLimits(redis)
    startup.freeze_heap()
    consumer = args.consumer_name or f"{socket.gethostname()}-{os.getpid()}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # The large queue's requests go one at a time (each replica takes one, the others wait for
    # the next free replica) and leave the stream once handled.
    small = RendererService(redis, renderer, streams.render_stream(), limits=limits, stop=stop)
    large = RendererService(
        redis, renderer, streams.render_large_stream(), True, limits=limits, stop=stop
    )
    lanes = [(small, 64), (large, 1)]
    logger.info("renderer %s consuming %s", consumer, ", ".join(s.stream for s, _ in lanes))
    try:
        await asyncio.gather(
            *(
                streams.consume(
                    redis,
                    service.stream,
                    streams.RENDER_GROUP,
                    consumer,
                    service.handle_batch,
                    stop=stop,
                    count=count,
                    after_batch=service.after_batch,
                    batch=True,
                )
                for service, count in lanes
            )
        )
    finally:
        await redis.aclose()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    setup_logging("renderer", args.log_level, args.log_json)
    metrics.serve_process_metrics(args.metrics_port)
    asyncio.run(serve(args))
    # Everything is closed. Skip the interpreter's teardown of the tokenizer's large object
    # graph, which takes seconds on a busy machine and makes a clean stop look like a hang.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
