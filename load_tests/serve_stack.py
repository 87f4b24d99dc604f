"""A `voltserve serve` stack on loopback for the soak and fault runs, the ops tests and the
real-shape GPU tests: the launcher as a subprocess (on the CPU unless gpu=True), its children
found by pid, the embedded Redis URL read from the launcher's log. Standard library plus
redis-py only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from voltserve.cli import command as voltserve_command

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_demo_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        subprocess.run(
            [*voltserve_command(), "make-demo-model", str(path)],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return path


def http_json(
    url: str, body: dict | None = None, timeout: float = 5.0, api_key: str | None = None
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    try:
        out = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(x) for x in out]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


class ServeStack:
    """`voltserve serve` on 127.0.0.1:<free port>. Use as a context manager. gpu: the GPUs this
    process sees are the server's too (default: none, CUDA_VISIBLE_DEVICES empty)."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        extra: list[str] | None = None,
        start_timeout_s: float = 300.0,
        api_key: str | None = None,
        gpu: bool = False,
    ) -> None:
        self.model = model
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra or []
        self.start_timeout_s = start_timeout_s
        self.api_key = api_key  # passed as --api-key, and sent by the readiness check
        self.gpu = gpu
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "serve.log"
        self.redis_url: str | None = None
        self.model_name: str | None = None

    def __enter__(self) -> ServeStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [*voltserve_command(), "serve", "--model", str(self.model)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *self.extra]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"voltserve serve exited ({self.proc.returncode}):\n{self.log()}"
                )
            if self.redis_url is None:
                m = re.search(r"embedded valkey server at (redis://\S+?)\"?(\s|$)", self.log())
                if m:
                    self.redis_url = m.group(1)
            try:
                status, body = http_json(self.url + "/v1/models", timeout=2, api_key=self.api_key)
                hs, _ = http_json(self.url + "/health", timeout=2)
                if status == 200 and hs == 200 and body["data"]:
                    self.model_name = body["data"][0]["id"]
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"stack not ready in {self.start_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def services(self) -> dict[str, int]:
        """Service name ("gateway", "scheduler", "renderer", "executor:exec-0") -> pid."""
        out: dict[str, int] = {}
        if self.proc is None:
            return out
        for pid in child_pids(self.proc.pid):
            args = cmdline(pid)
            if "voltserve.cli" not in args:
                continue
            cmd = args[args.index("voltserve.cli") + 1]
            name = cmd
            if cmd == "executor" and "--executor-id" in args:
                name = f"executor:{args[args.index('--executor-id') + 1]}"
            elif cmd == "renderer" and "--consumer-name" in args:
                name = f"renderer:{args[args.index('--consumer-name') + 1]}"
            out[name] = pid
        return out

    def broker_pid(self) -> int | None:
        """The embedded valkey server's pid (None without one, or while it is restarted)."""
        if self.proc is None:
            return None
        for pid in child_pids(self.proc.pid):
            args = cmdline(pid)
            # valkey sets its process title ("valkey-server 127.0.0.1:PORT"): one argument.
            if args and "valkey-server" in args[0]:
                return pid
        return None

    def rss(self) -> dict[str, int]:
        return {n: r for n, p in self.services().items() if (r := rss_bytes(p)) is not None}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def executor_statuses(redis_url: str) -> dict[str, dict[str, str]]:
    """Every executor's status hash (alive or not), decoded."""
    import redis
    from voltserve.shared import streams

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        ids = sorted(r.smembers(streams.executors_key()))
        out = {}
        for eid in ids:
            h = r.hgetall(streams.executor_status_key(eid))
            h["alive"] = "1" if r.exists(streams.executor_alive_key(eid)) else "0"
            out[eid] = h
        return out
    finally:
        r.close()


def scrape(url: str) -> dict[str, float]:
    """GET url/metrics -> {series (name{labels}): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            out[series] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    total = 0.0
    for series, v in metrics.items():
        base, _, rest = series.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total
