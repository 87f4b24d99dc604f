"""The executor service: an LLMEngine on its own thread, Redis I/O on an asyncio loop.

Engine thread: takes commands from a thread-safe inbox, steps the engine, and hands one
StepOutput per gateway per step to the I/O loop. The GPU never waits on Redis: a step's outputs
are queued and the next step starts at once.

I/O loop: reads EngineRequest/AbortRequest from vs:exec:{id} (consumer group, idempotent by
request id), writes StepOutputs to vs:gw:{gateway_id}, refreshes the heartbeat and status hash.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from voltserve.services.executor import crash_hook
from voltserve.shared import broker, streams
from voltserve.shared.metrics import StatusHistogram, stats_to_status
from voltserve.shared.model_limits import ModelLimits
from voltserve.shared.protocol import (
    AbortRequest,
    EngineRequest,
    RequestDelta,
    RequestError,
    StepOutput,
)
from voltserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How many finished request ids to remember for idempotency (a redelivered request is ignored).
SEEN_CAPACITY = 200_000


class Engine(Protocol):
    max_model_len: int

    def add_request(self, request_id, prompt_token_ids, params, output_token_ids=None, arrival_time=None, validated=False) -> None: ...  # fmt: skip
    def limits(self) -> ModelLimits: ...
    def abort_request(self, ids: list[str]) -> list[Any]: ...
    def step(self) -> list[Any]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> Any: ...


@dataclass
class ServiceConfig:
    executor_id: str
    redis_url: str
    model: str
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    max_num_seqs: int = 256
    redis_outage_timeout_s: float = broker.DEFAULT_OUTAGE_TIMEOUT_S


def _logprobs_to_wire(sampled: list[Any] | None) -> list[dict[str, Any]] | None:
    if sampled is None:
        return None
    out = []
    for s in sampled:
        top = [[int(t), float(lp)] for t, lp in s.top_logprobs] if s.top_logprobs else None
        out.append({"logprob": float(s.logprob) if s.logprob is not None else None, "top": top})
    return out


class EngineLoop:
    """Owns the engine; runs on its own thread. Everything engine-related happens here."""

    def __init__(self, engine: Engine, executor_id: str) -> None:
        self.engine = engine
        self.executor_id = executor_id
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # (gateway_id, message) pairs for the I/O loop; set by ExecutorService.
        self.emit: Any = None
        self.stop_event = threading.Event()
        self.step_count = 0
        self.latest_stats: Any = None
        # request_id -> (gateway_id, output offset of the next token)
        self.live: dict[str, list[Any]] = {}
        # vllm:request_queue_time_seconds, carried in the status hash (shared/metrics.py).
        self.queue_time = StatusHistogram("queue_time")
        self.error: BaseException | None = None
        self._crash_marker = crash_hook.crash_marker()  # tests only: () otherwise

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - recorded and re-raised by the service
            logger.exception("engine loop crashed")
            self.error = e

    def _run(self) -> None:
        self.latest_stats = self.engine.stats()
        # One DEBUG line per step (--log-level debug): when requests reached the engine and how
        # full each step ran, e.g. while a burst arrives through the services.
        debug = logger.isEnabledFor(logging.DEBUG)
        added = 0
        while not self.stop_event.is_set():
            busy = self.engine.has_unfinished_requests()
            applied = self._drain_inbox(block=not busy)
            added += applied
            idle = not self.engine.has_unfinished_requests()
            if applied or idle:
                # An abort (or an add) changes the block and request counts without a step:
                # the status hash must see that even when no step follows (an abort of the
                # last running request leaves the engine idle).
                self.latest_stats = self.engine.stats()
            if idle:
                continue
            step_start = time.time()
            outputs = self.engine.step()
            self.step_count += 1
            self.latest_stats = self.engine.stats()
            if debug:
                st = self.latest_stats
                kv = {
                    "step": self.step_count,
                    "ms": round((time.time() - step_start) * 1e3, 3),
                    "added": added,
                    "running": st.num_running,
                    "waiting": st.num_waiting,
                    "outputs": len(outputs),
                }
                logger.debug("step", extra={"kv": kv})
            added = 0
            if outputs:
                self._publish(outputs, step_start)

    def _drain_inbox(self, block: bool) -> int:
        """Apply every queued command; how many there were."""
        try:
            cmd = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return 0
        n = 0
        while True:
            self._apply(*cmd)
            n += 1
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return n

    def _apply(self, kind: str, msg: Any) -> None:
        if kind == "add":
            self._add(msg)
        elif kind == "abort":
            ids = [i for i in msg.request_ids if i in self.live]
            if not ids:
                return
            outputs = self.engine.abort_request(ids)
            if msg.reason == "failover":
                # The scheduler moved these elsewhere (we were presumed dead): the client's
                # stream goes on from the other executor, so end them here without a word.
                for i in ids:
                    self.live.pop(i, None)
            elif outputs:
                self._publish(outputs)

    def _add(self, req: EngineRequest) -> None:
        if req.request_id in self.live:
            # A failover resend of a request this engine still runs (it was presumed dead):
            # the resend wins; drop the old copy quietly.
            self.engine.abort_request([req.request_id])
            del self.live[req.request_id]
        max_len = self.engine.max_model_len
        if req.output_token_ids:
            if len(req.prompt_token_ids) + len(req.output_token_ids) >= max_len:
                # A resumed request that had already filled the context: it ends as it would
                # have on the executor that died.
                n = len(req.output_token_ids)
                delta = RequestDelta(req.request_id, [], n, finish_reason="length")
                self.emit(req.gateway_id, StepOutput(self.executor_id, self.step_count, [delta]))
                return
        try:
            params = SamplingParams.from_dict(dict(req.sampling))
            # Validated where the request entered (the gateway); the renderer only lowered
            # max_tokens / min_tokens to the context and set the eos ids.
            self.engine.add_request(
                req.request_id,
                list(req.prompt_token_ids),
                params,
                output_token_ids=list(req.output_token_ids) or None,
                arrival_time=req.arrival_time or None,
                validated=True,
            )
        except (ValueError, TypeError) as e:
            logger.warning("rejecting request %s: %s", req.request_id, e)
            err = RequestError(req.request_id, 400, str(e))
            self.emit(req.gateway_id, err)
            return
        # Third item: arrival time until the first output (a failover resend has no queue time).
        arrival = 0.0 if req.output_token_ids else req.arrival_time
        self.live[req.request_id] = [req.gateway_id, len(req.output_token_ids), arrival]
        if self._crash_marker and crash_hook.holds(req.prompt_token_ids, self._crash_marker):
            raise RuntimeError(f"{crash_hook.ENV}: request {req.request_id} crashes the engine")

    def _publish(self, outputs: list[Any], step_start: float = 0.0) -> None:
        by_gateway: dict[str, list[RequestDelta]] = {}
        live = self.live
        # Runs for every request every step: positional construction, no helper call when
        # there are no logprobs.
        for o in outputs:
            rid = o.request_id
            entry = live.get(rid)
            if entry is None:
                continue
            gateway_id, offset, arrival = entry
            if getattr(o, "error", None) is not None:
                # Ended with an error instead of tokens (a constraint that failed to compile,
                # non-finite logits): the client gets an error response, never a silent end.
                del live[rid]
                status = o.error_status
                kind = o.error_type or (
                    "internal_server_error" if status >= 500 else "invalid_request_error"
                )
                self.emit(gateway_id, RequestError(rid, status, o.error, kind, o.error_param))
                continue
            if arrival and step_start:
                self.queue_time.observe(max(0.0, step_start - arrival))
                entry[2] = 0.0
            token_ids = [int(t) for t in o.new_token_ids]
            lp = o.new_logprobs
            delta = RequestDelta(
                rid,
                token_ids,
                offset,
                None if lp is None else _logprobs_to_wire(lp),
                o.finish_reason,
                o.num_prompt_tokens,
                o.num_cached_tokens,
            )
            if o.prompt_logprobs is not None:
                delta.prompt_logprobs = o.prompt_logprobs
                delta.prompt_token_ids = o.prompt_token_ids
            entry[1] = offset + len(token_ids)
            if o.finish_reason is not None:
                del live[rid]
            deltas = by_gateway.get(gateway_id)
            if deltas is None:
                by_gateway[gateway_id] = [delta]
            else:
                deltas.append(delta)
        for gateway_id, deltas in by_gateway.items():
            self.emit(gateway_id, StepOutput(self.executor_id, self.step_count, deltas))


class ExecutorService:
    def __init__(self, engine: Engine, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.instance = uuid.uuid4().hex[:12]
        self.loop_ = EngineLoop(engine, cfg.executor_id)
        # (request_id, resume offset): a redelivery repeats both; a failover resend differs.
        self.seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.stop = asyncio.Event()
        self._outbox: asyncio.Queue[tuple[str, Any]] | None = None
        self._limits = engine.limits().to_status()

    # ---- engine thread -> I/O loop ----

    def _emit_threadsafe(self, aloop: asyncio.AbstractEventLoop):
        def emit(gateway_id: str, msg: Any) -> None:
            aloop.call_soon_threadsafe(self._outbox.put_nowait, (gateway_id, msg))

        return emit

    async def _writer(self, r) -> None:
        assert self._outbox is not None
        while not self.stop.is_set():
            try:
                item = await asyncio.wait_for(self._outbox.get(), timeout=0.5)
            except TimeoutError:
                continue
            batch = [item]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            async with r.pipeline(transaction=False) as p:
                for gateway_id, msg in batch:
                    await streams.xadd(
                        p, streams.gw_stream(gateway_id), msg, maxlen=streams.OUTPUT_MAXLEN
                    )
                await p.execute()

    # ---- Redis -> engine thread ----

    async def _handle(self, msg_id: bytes, msg: Any) -> None:
        if isinstance(msg, EngineRequest):
            key = (msg.request_id, len(msg.output_token_ids))
            if key in self.seen:
                logger.info("ignoring redelivered request %s", msg.request_id)
                return
            self.seen[key] = None
            if len(self.seen) > SEEN_CAPACITY:
                self.seen.popitem(last=False)
            self.loop_.inbox.put(("add", msg))
        elif isinstance(msg, AbortRequest):
            self.loop_.inbox.put(("abort", msg))
        else:
            logger.error("unexpected %s on %s", type(msg).__name__, self._stream)

    @property
    def _stream(self) -> str:
        return streams.exec_stream(self.cfg.executor_id)

    async def _heartbeat(self, r) -> None:
        last_steps, last_t = 0, time.monotonic()
        while not self.stop.is_set():
            # Re-announced every beat: the scheduler forgets executors that stayed dead.
            await r.sadd(streams.executors_key(), self.cfg.executor_id)
            now = time.monotonic()
            steps = self.loop_.step_count
            rate = (steps - last_steps) / max(1e-6, now - last_t)
            last_steps, last_t = steps, now
            s = self.loop_.latest_stats
            status: dict[str, Any] = {
                "executor_id": self.cfg.executor_id,
                "instance": self.instance,
                "model": self.cfg.model,
                "max_num_seqs": self.cfg.max_num_seqs,
                # max_model_len, eos_token_ids, vocab_size: what the gateway and the renderer
                # hold requests to (shared/model_limits.py).
                **self._limits,
                "step_rate": round(rate, 2),
                "steps": steps,
                "time": time.time(),
            }
            if s is not None:
                # Every numeric EngineStats field (per-position counters flattened to name_i).
                status.update(stats_to_status(s))
            status.update(self.loop_.queue_time.to_status())
            await streams.set_heartbeat(
                r,
                streams.executor_alive_key(self.cfg.executor_id),
                streams.executor_status_key(self.cfg.executor_id),
                status,
                self.cfg.heartbeat_ttl_s,
            )
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    async def run(self) -> None:
        aloop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self.loop_.emit = self._emit_threadsafe(aloop)
        # Every command below rides out a broker outage (shared/broker.py): the engine keeps
        # stepping, its outputs queue up in the outbox and go out, in order, once it is back.
        r = streams.connect(self.cfg.redis_url, outage_timeout_s=self.cfg.redis_outage_timeout_s)
        # A previous incarnation's queue was failed over by the scheduler: start from a clean
        # stream so its requests are not run twice.
        await r.delete(self._stream)
        await streams.ensure_group(r, self._stream, streams.EXEC_GROUP, start_id="$")
        thread = threading.Thread(target=self.loop_.run, name="engine-loop", daemon=True)
        thread.start()
        consumer = f"{self.cfg.executor_id}-{self.instance}"
        tasks = [
            asyncio.create_task(
                streams.consume(
                    r, self._stream, streams.EXEC_GROUP, consumer, self._handle, stop=self.stop
                )
            ),
            asyncio.create_task(self._writer(r)),
            asyncio.create_task(self._heartbeat(r)),
        ]
        logger.info(
            "executor %s (instance %s) ready on %s",
            self.cfg.executor_id,
            self.instance,
            self._stream,
        )
        try:
            while not self.stop.is_set():
                if not thread.is_alive():
                    raise RuntimeError(f"engine loop died: {self.loop_.error!r}")
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        raise t.exception()
                await asyncio.sleep(0.2)
        finally:
            logger.info("executor %s stopping", self.cfg.executor_id)
            self.loop_.stop_event.set()
            for t in tasks:
                t.cancel()
            # Every loop also watches `stop`: a cancellation swallowed inside a Redis call must
            # not keep the process alive.
            await asyncio.wait(tasks, timeout=3)
            try:
                # Gone at once: the scheduler fails our requests over without waiting for the TTL.
                await asyncio.wait_for(
                    r.delete(streams.executor_alive_key(self.cfg.executor_id)), timeout=2
                )
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                logger.warning("could not clear the heartbeat on the way out: %r", e)
            await r.aclose()
            logger.info("executor %s stopped", self.cfg.executor_id)
