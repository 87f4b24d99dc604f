"""Redis Streams helpers shared by every service: stream and key names, consumer groups, trimmed
XADD, and the at-least-once consumer loop (XREADGROUP -> handler -> XACK, XAUTOCLAIM of messages
whose consumer died).

Every payload is one field, b"d", holding msgpack bytes from shared/protocol.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from voltserve.shared import broker
from voltserve.shared.protocol import decode, encode

logger = logging.getLogger(__name__)

PAYLOAD = b"d"
# Default approximate stream lengths. Work queues are consumed promptly; output streams are
# tailed by the gateway and the scheduler, so they only need a short history.
WORK_MAXLEN = 100_000
OUTPUT_MAXLEN = 20_000

RENDER_GROUP = "renderers"
SCHED_GROUP = "scheduler"
EXEC_GROUP = "executor"


# ---- stream and key names -------------------------------------------------------------------


def render_stream() -> str:
    return "vs:render"


# A RenderRequest whose payload is larger than this (a long prompt or conversation), or that
# carries a grammar constraint (xgrammar validates it), goes to the large queue, which renderers
# consume beside vs:render: a small request never waits behind a large one.
LARGE_RENDER_BYTES = 16 * 1024


def render_large_stream() -> str:
    return "vs:render:large"


def sched_stream() -> str:
    return "vs:sched"


def exec_stream(executor_id: str) -> str:
    return f"vs:exec:{executor_id}"


def gw_stream(gateway_id: str) -> str:
    return f"vs:gw:{gateway_id}"


def gateways_key() -> str:
    """Set of gateway ids; gateways SADD themselves so the scheduler can tail their streams."""
    return "vs:gateways"


def executors_key() -> str:
    """Set of executor ids that have ever announced themselves (alive or not)."""
    return "vs:executors"


def executor_alive_key(executor_id: str) -> str:
    """Heartbeat: exists while the executor is alive (SET with a short PX TTL, refreshed)."""
    return f"vs:hb:exec:{executor_id}"


def executor_status_key(executor_id: str) -> str:
    """Status hash: free/total KV blocks, running, waiting, model, step rate, instance."""
    return f"vs:status:exec:{executor_id}"


def gateway_alive_key(gateway_id: str) -> str:
    return f"vs:hb:gw:{gateway_id}"


def scheduler_lease_key() -> str:
    return "vs:sched:leader"


def scheduler_routes_key() -> str:
    """Hash request_id -> routing record of unfinished requests (survives a leader change)."""
    return "vs:sched:routes"


# ---- basic operations -----------------------------------------------------------------------


def connect(
    url: str, max_connections: int = 512, outage_timeout_s: float | None = None
) -> aioredis.Redis:
    """A client that rides out a broker outage (shared/broker.py: connect)."""
    return broker.connect(url, outage_timeout_s=outage_timeout_s, max_connections=max_connections)


async def ensure_group(r: aioredis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create the consumer group (and the stream). An existing group is fine."""
    try:
        await r.xgroup_create(stream, group, id=start_id, mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def xadd(r: Any, stream: str, msg: Any, maxlen: int = WORK_MAXLEN) -> Any:
    """Append a protocol message, trimming the stream with MAXLEN ~. `r` may be a pipeline."""
    return await _maybe_await(
        r.xadd(stream, {PAYLOAD: encode(msg)}, maxlen=maxlen, approximate=True)
    )


async def _maybe_await(x: Any) -> Any:
    # Pipelines queue commands synchronously and return the pipeline itself.
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        return await x
    return x


def decode_fields(fields: dict[bytes, bytes]) -> Any:
    """Stream entry fields -> protocol message. ValueError when malformed."""
    data = fields.get(PAYLOAD)
    if data is None:
        raise ValueError(f"stream entry without a {PAYLOAD!r} field: {list(fields)}")
    return decode(data)


async def set_heartbeat(
    r: aioredis.Redis,
    alive_key: str,
    status_key: str | None,
    status: dict[str, Any] | None,
    ttl_s: float,
) -> None:
    """Refresh a heartbeat key with a TTL and (optionally) its status hash, in one round trip."""
    ttl_ms = max(1, int(ttl_s * 1000))
    async with r.pipeline(transaction=False) as p:
        p.set(alive_key, str(time.time()), px=ttl_ms)
        if status_key is not None and status:
            p.hset(status_key, mapping={k: str(v) for k, v in status.items()})
            # The hash outlives the heartbeat a little so the scheduler can read the last state.
            p.pexpire(status_key, ttl_ms * 10)
        await p.execute()


async def read_status(r: aioredis.Redis, status_key: str) -> dict[str, str]:
    raw = await r.hgetall(status_key)
    return {k.decode(): v.decode() for k, v in raw.items()}


# ---- the consumer loop ----------------------------------------------------------------------

Handler = Callable[[bytes, Any], Awaitable[None]]
# A batch handler takes every decoded message of one read at once: (msg_id, message) pairs.
BatchHandler = Callable[[list[tuple[bytes, Any]]], Awaitable[None]]


def default_claim_idle_ms() -> int:
    # Tests shorten this through the environment so they need not thread a flag through
    # every service; production keeps 30 s (a message is reclaimed only when its consumer died).
    return int(os.environ.get("VOLTSERVE_CLAIM_IDLE_MS", "30000"))


async def consume(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    handler: Handler | BatchHandler,
    *,
    stop: asyncio.Event | None = None,
    count: int = 64,
    block_ms: int = 200,
    claim_idle_ms: int | None = None,
    claim_interval_s: float | None = None,
    after_batch: Callable[[], Awaitable[None]] | None = None,
    batch: bool = False,
) -> None:
    """Run until `stop` is set: XREADGROUP new messages, `await handler(msg_id, message)` for each,
    XACK them afterwards (one XACK per batch read). Every `claim_interval_s`, XAUTOCLAIM messages
    idle longer than `claim_idle_ms` (their consumer died) and handle them the same way.

    after_batch, when given, is awaited after the handlers of a batch and before its XACK: a
    consumer that defers per-message writes to one round trip per batch makes them there, and
    they are durable before the messages are acknowledged.

    batch=True passes `handler` every decodable message of a read at once (a BatchHandler), in
    stream order, so it can make one round trip and one thread hop for the batch; it must turn
    a bad message into its own reply. An exception from it propagates like one from
    after_batch (the batch stays unacknowledged and is redelivered).

    A handler that raises is logged loudly and its message is acked anyway: a poison message
    must not be redelivered forever. Malformed payloads are treated the same way. Delivery is
    at-least-once, so handlers must be idempotent by request id.

    With a client from connect(), a broker outage pauses the loop (shared/broker.py); once the
    broker is back the group is re-created if it lost it, and our own pending messages are
    handled again (acknowledgements sent just before the outage may be lost with it).
    """
    stop = stop or asyncio.Event()
    claim_idle_ms = default_claim_idle_ms() if claim_idle_ms is None else claim_idle_ms
    if claim_interval_s is None:
        claim_interval_s = max(0.1, claim_idle_ms / 2000)
    link = broker.link_of(r)
    epoch = link.epoch if link is not None else 0
    await ensure_group(r, stream, group)
    # First re-handle our own pending messages (a restart with the same consumer name).
    own_pending_id: str | bytes | None = "0"
    next_claim = time.monotonic()
    while not stop.is_set():
        try:
            if link is not None and link.epoch != epoch:
                epoch = link.epoch
                await ensure_group(r, stream, group)
                own_pending_id = "0"
            if own_pending_id is not None:
                resp = await r.xreadgroup(group, consumer, {stream: own_pending_id}, count=count)
                entries = resp[0][1] if resp else []
                own_pending_id = entries[-1][0] if entries else None
                await _handle_all(r, stream, group, handler, entries, after_batch, batch)
                continue
            if time.monotonic() >= next_claim:
                next_claim = time.monotonic() + claim_interval_s
                await _autoclaim(
                    r,
                    stream,
                    group,
                    consumer,
                    handler,
                    claim_idle_ms,
                    count,
                    after_batch,
                    batch,
                )
            resp = await r.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
            if resp:
                await _handle_all(r, stream, group, handler, resp[0][1], after_batch, batch)
        except (asyncio.CancelledError, broker.BrokerGone):
            raise
        except ResponseError as e:
            if "NOGROUP" in str(e):
                # Somebody deleted the stream (e.g. a failed-over executor's queue): recreate.
                logger.warning("stream %s lost its group; recreating", stream)
                await ensure_group(r, stream, group)
                continue
            logger.exception("redis error consuming %s", stream)
            await asyncio.sleep(0.5)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            logger.error("redis connection error consuming %s: %s; retrying", stream, e)
            await asyncio.sleep(0.5)


async def _autoclaim(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    handler: Handler | BatchHandler,
    idle_ms: int,
    count: int,
    after_batch: Callable[[], Awaitable[None]] | None = None,
    batch: bool = False,
) -> None:
    start = "0-0"
    while True:
        resp = await r.xautoclaim(stream, group, consumer, idle_ms, start_id=start, count=count)
        # redis-py returns [next_id, entries, deleted_ids] (Redis >= 7).
        next_id, entries = resp[0], resp[1]
        entries = [e for e in entries if e is not None and e[1] is not None]
        if entries:
            logger.warning(
                "reclaimed %d message(s) from a dead consumer on %s", len(entries), stream
            )
            await _handle_all(r, stream, group, handler, entries, after_batch, batch)
        if next_id in (b"0-0", "0-0"):
            return
        start = next_id


async def _handle_all(
    r: aioredis.Redis,
    stream: str,
    group: str,
    handler: Handler | BatchHandler,
    entries: list[tuple[bytes, dict[bytes, bytes]]],
    after_batch: Callable[[], Awaitable[None]] | None = None,
    batch: bool = False,
) -> None:
    async def one(msg_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            if fields:  # a deleted entry still in the PEL comes back with no fields
                msg = decode_fields(fields)
                await handler(msg_id, msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Loud, and acked below: a message that breaks its handler must not loop forever.
            logger.exception("handler failed on %s message %s; dropping it", stream, msg_id)

    if not entries:
        return
    if batch:
        items = []
        for msg_id, fields in entries:
            if not fields:  # a deleted entry still in the PEL comes back with no fields
                continue
            try:
                items.append((msg_id, decode_fields(fields)))
            except Exception:
                logger.exception("undecodable %s message %s; dropping it", stream, msg_id)
        if items:
            # Not caught: a failure leaves the batch unacknowledged, as after_batch's does.
            await handler(items)  # type: ignore[call-arg, arg-type]
    else:
        for msg_id, fields in entries:
            await one(msg_id, fields)
    if after_batch is not None:
        # A failure here propagates (consume logs and retries the read): the batch stays
        # unacknowledged, so its messages are redelivered rather than lost.
        await after_batch()
    # One XACK for the batch: a crash before it redelivers the batch, which idempotent
    # handlers absorb.
    await r.xack(stream, group, *(m for m, _ in entries))


async def tail(
    r: aioredis.Redis,
    streams: dict[str, str],
    *,
    count: int = 256,
    block_ms: int = 200,
    decoder: Callable[[bytes], Any] = decode,
) -> list[tuple[str, bytes, Any]]:
    """One plain XREAD over several streams. Updates `streams` (name -> last id) in place and
    returns (stream, msg_id, message) for every decodable entry. `decoder` turns a payload into
    the message (ValueError when malformed); a reader that needs only part of each message can
    pass a cheaper one."""
    if not streams:
        await asyncio.sleep(block_ms / 1000)
        return []
    resp = await r.xread(streams, count=count, block=block_ms)
    out: list[tuple[str, bytes, Any]] = []
    for name, entries in resp or []:
        name = name.decode() if isinstance(name, bytes) else name
        for msg_id, fields in entries:
            streams[name] = msg_id.decode() if isinstance(msg_id, bytes) else msg_id
            try:
                data = fields.get(PAYLOAD)
                if data is None:
                    raise ValueError(f"stream entry without a {PAYLOAD!r} field: {list(fields)}")
                out.append((name, msg_id, decoder(data)))
            except ValueError:
                logger.exception("malformed entry %s on %s; skipping", msg_id, name)
    return out
