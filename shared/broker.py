"""The connection to the message broker (Redis or Valkey), and how a service rides out its outage.

Every service talks to the broker through a client from `connect()`. When a command fails for
want of the broker (connection refused or reset, a timeout, a broker still loading its
append-only file, a Sentinel without a primary), the client does not raise: the process's
`BrokerLink` notes the outage (one log line), pings the broker with a bounded backoff, and the
command runs again once it answers. Every loop of every service therefore pauses through a
broker restart or failover and carries on where it was, with its in-memory state intact; a
retried write may land twice, which the receivers absorb (delivery is at-least-once and every
handler is idempotent).

An outage longer than the limit (`--redis-outage-timeout`, default 60 s) ends the process with a
clear message and exit status 1 (a supervisor restarts it). `link.epoch` counts the outages the
process came through: a loop that must re-establish something after one (re-read its own pending
entries, rewrite what the broker may have lost) compares it. A restart can also pass without a
single failed command (redis-py reconnects a pooled connection the server closed before using
it), so every new connection also reads the server's run id: a new one counts as an outage.

Code that must answer at once instead of waiting (the gateway's `/health`, its new requests)
runs under `fail_fast()`: a command then raises `BrokerUnavailable` while the broker is away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from voltserve.shared.broker_url import is_sentinel, parse_sentinel_url, redact

logger = logging.getLogger("voltserve.broker")

DEFAULT_OUTAGE_TIMEOUT_S = 60.0
BROKER_LOST_EXIT_CODE = 1
# Probe backoff: quick at first (a supervised broker is back within a second or two), then at
# most one ping a second per process.
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
# A broker that does not answer within this is treated as away (blocking reads wait at most a
# second; nothing else takes long).
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0

# Errors that mean "the broker is away", not "the command is wrong". BusyLoadingError (a broker
# replaying its append-only file) and Sentinel's MasterNotFoundError are ConnectionErrors.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)

_fail_fast: contextvars.ContextVar[bool] = contextvars.ContextVar("broker_fail_fast", default=False)


class BrokerUnavailable(RedisConnectionError):
    """Raised under fail_fast() while the broker is away."""


class BrokerGone(RedisConnectionError):
    """The broker stayed away past the outage limit; the process is exiting."""


class BrokerLink:
    """Outage state of one broker, shared by every client of this process that talks to it."""

    def __init__(self, url: str, outage_timeout_s: float = DEFAULT_OUTAGE_TIMEOUT_S) -> None:
        self.url = redact(url)
        self.outage_timeout_s = outage_timeout_s
        self.down_since: float | None = None  # time.monotonic() of the outage's first error
        self.last_error = ""
        self.epoch = 0  # outages this process came through
        self.run_id: bytes | None = None  # the server's, as seen by the last new connection
        self.gone = False
        self._back: asyncio.Event | None = None
        self._probe: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ping: Callable[[], Awaitable[Any]] | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def status(self) -> dict[str, Any]:
        """What /health reports about the broker."""
        return {
            "url": self.url,
            "reachable": not self.down,
            "down_for_s": round(self.down_for(), 1),
            "outage_timeout_s": self.outage_timeout_s,
            "last_error": self.last_error if self.down else "",
            "outages": self.epoch,
        }

    def unavailable_message(self) -> str:
        return (
            f"the message broker ({self.url}) has been unreachable for {self.down_for():.0f} s; "
            "requests resume when it is back: retry shortly"
        )

    async def before_command(self) -> None:
        """While the broker is away: wait for it (or raise, under fail_fast)."""
        if self.gone:
            raise BrokerGone(f"the message broker {self.url} is gone")
        if self.down_since is None:
            return
        if self._loop is not asyncio.get_running_loop():
            # An outage noted under an event loop that has since closed (tests run one loop
            # after another): nothing waits on it any more.
            self.down_since = None
            return
        if _fail_fast.get():
            raise BrokerUnavailable(self.unavailable_message())
        assert self._back is not None
        await self._back.wait()
        if self.gone:
            raise BrokerGone(f"the message broker {self.url} is gone")

    async def on_error(self, err: BaseException, ping: Callable[[], Awaitable[Any]]) -> None:
        """A command failed for want of the broker: note the outage and wait until it is back
        (under fail_fast, raise BrokerUnavailable instead). `ping` asks the broker through the
        client that failed, bypassing the ride-out."""
        loop = asyncio.get_running_loop()
        if self.down_since is None or self._loop is not loop:
            self.ping = ping
            self.down_since = time.monotonic()
            self.last_error = f"{type(err).__name__}: {err}"
            self._loop = loop
            self._back = asyncio.Event()
            self._probe = loop.create_task(self._probe_until_back(), name="broker-probe")
            # Its SystemExit ends the event loop; retrieved here so asyncio does not also print
            # it as an exception nobody retrieved.
            self._probe.add_done_callback(lambda t: t.cancelled() or t.exception())
            logger.error(
                "lost the message broker %s (%s); waiting up to %.0f s for it to come back "
                "(--redis-outage-timeout)",
                self.url,
                self.last_error,
                self.outage_timeout_s,
            )
        await self.before_command()

    async def note_server(self, conn: Any) -> None:
        """On every new connection: a server with another run id than the last one seen is a
        restarted (or failed-over) broker, an outage even if no command failed."""
        try:
            await conn.send_command("INFO", "server", check_health=False)
            info = await conn.read_response()
        except ResponseError:
            return  # INFO not allowed here: restarts are seen through failed commands only
        run_id = next(
            (line[7:].strip() for line in bytes(info).splitlines() if line.startswith(b"run_id:")),
            None,
        )
        if run_id is None or run_id == self.run_id:
            return
        known, self.run_id = self.run_id, run_id
        if known is not None and self.down_since is None:
            logger.warning(
                "the message broker %s restarted (a new server answers the same address)",
                self.url,
            )
            self.epoch += 1

    async def _probe_until_back(self) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            try:
                assert self.ping is not None
                await self.ping()
                break
            except (*OUTAGE_ERRORS, RedisError) as e:
                # Not back yet, whatever it answers (a replica not yet promoted: MASTERDOWN).
                self.last_error = f"{type(e).__name__}: {e}"
            if self.down_for() > self.outage_timeout_s:
                self.gone = True
                assert self._back is not None
                self._back.set()  # waiters raise BrokerGone and unwind
                logger.critical(
                    "the message broker %s has been unreachable for %.0f s (limit %.0f s, "
                    "--redis-outage-timeout); exiting. Last error: %s",
                    self.url,
                    self.down_for(),
                    self.outage_timeout_s,
                    self.last_error,
                )
                raise SystemExit(BROKER_LOST_EXIT_CODE)
            delay = min(BACKOFF_MAX_S, delay * 2)
        logger.warning("the message broker %s is back after %.1f s", self.url, self.down_for())
        self.down_since = None
        self.epoch += 1
        assert self._back is not None
        self._back.set()


class BrokerClient(aioredis.Redis):
    """A Redis client whose commands ride out a broker outage (see the module docstring)."""

    broker_link: BrokerLink

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        link = self.broker_link
        while True:
            await link.before_command()
            try:
                return await super().execute_command(*args, **options)
            except MaxConnectionsError:
                raise
            except OUTAGE_ERRORS as e:
                await link.on_error(e, self._ping)

    async def _ping(self) -> Any:
        return await aioredis.Redis.execute_command(self, "PING")

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        p = BrokerPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        p.broker_link = self.broker_link
        p.ping_via = self._ping
        return p


class BrokerPipeline(Pipeline):
    """A pipeline that runs again, whole, once the broker is back. Its commands may then apply
    twice (the first attempt can land before the connection broke): the callers' writes are
    idempotent or absorbed by their receivers."""

    broker_link: BrokerLink
    ping_via: Callable[[], Awaitable[Any]]

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        link = self.broker_link
        queued = list(self.command_stack)
        while True:
            await link.before_command()
            try:
                return await super().execute(raise_on_error)
            except MaxConnectionsError:
                raise
            except OUTAGE_ERRORS as e:
                await link.on_error(e, self.ping_via)
                self.command_stack = list(queued)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's primary-following pool, with the blocking pool's wait for a free connection."""


def _watched(connection_class: type, link: BrokerLink) -> type:
    """`connection_class` whose every new connection tells `link` which server answered."""

    class Watched(connection_class):  # type: ignore[misc, valid-type]
        async def on_connect_check_health(self, check_health: bool = True) -> None:
            await super().on_connect_check_health(check_health=check_health)
            await link.note_server(self)

    Watched.__name__ = Watched.__qualname__ = f"Watched{connection_class.__name__}"
    return Watched


_links: dict[str, BrokerLink] = {}


def connect(
    url: str, outage_timeout_s: float | None = None, max_connections: int = 512
) -> BrokerClient:
    """A client of the broker at `url` (Redis URL or redis+sentinel://, see broker_url.py). Its
    pool makes a burst of commands wait for a free connection (up to 30 s) instead of failing
    with "Too many connections" (a gateway with hundreds of streams open). Clients of one URL
    share one BrokerLink; `outage_timeout_s` sets its limit."""
    link = _links.get(url)
    if link is None:
        link = _links[url] = BrokerLink(url)
    if outage_timeout_s is not None:
        link.outage_timeout_s = outage_timeout_s
    common: dict[str, Any] = {
        "decode_responses": False,  # payloads are msgpack bytes
        "health_check_interval": 10,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        # No retries inside redis-py: an error reaches the link at once, so every process sees
        # every broker restart (and counts it in its epoch) even when the first retry would work.
        "retry": Retry(NoBackoff(), 0),
    }
    if is_sentinel(url):
        t = parse_sentinel_url(url)
        sentinel_kwargs = {"socket_timeout": CONNECT_TIMEOUT_S, "password": t.sentinel_password}
        sentinel = Sentinel(list(t.sentinels), sentinel_kwargs=sentinel_kwargs)
        client = sentinel.master_for(
            t.service,
            redis_class=BrokerClient,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=30,
            db=t.db,
            username=t.username,
            password=t.password,
            ssl=t.ssl,
            **common,
        )
    else:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=30, **common
        )
        client = BrokerClient.from_pool(pool)
    pool = client.connection_pool
    pool.connection_class = _watched(pool.connection_class, link)
    client.broker_link = link
    return client


def link_of(r: Any) -> BrokerLink | None:
    """The BrokerLink of a client from connect() (None for any other client)."""
    return getattr(r, "broker_link", None)


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Inside: a command raises BrokerUnavailable while the broker is away instead of waiting.
    (Tasks created inside inherit it.)"""
    token = _fail_fast.set(True)
    try:
        yield
    finally:
        _fail_fast.reset(token)


def add_broker_flags(p: argparse.ArgumentParser, embedded: bool = False) -> None:
    """--redis-url and --redis-outage-timeout. embedded=True (`voltserve serve`): no URL means
    an embedded broker."""
    if embedded:
        p.add_argument(
            "--redis-url",
            default=None,
            help="use this Redis instead of an embedded one (redis://, or "
            "redis+sentinel://host:port[,host:port]/service to follow a Sentinel failover)",
        )
    else:
        p.add_argument(
            "--redis-url",
            default=os.environ.get("VOLTSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
            help="the message broker: redis://, rediss://, unix:// or "
            "redis+sentinel://host:port[,host:port]/service (env VOLTSERVE_REDIS_URL)",
        )
    p.add_argument(
        "--redis-outage-timeout",
        type=positive_seconds,
        default=DEFAULT_OUTAGE_TIMEOUT_S,
        help="seconds a service waits for an unreachable message broker before it exits "
        f"(default {DEFAULT_OUTAGE_TIMEOUT_S:.0f})",
    )


def broker_argv(args: argparse.Namespace) -> list[str]:
    """The flags add_broker_flags declared, as a child service's arguments (without the URL)."""
    return ["--redis-outage-timeout", f"{args.redis_outage_timeout:g}"]


def positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v
