"""`voltserve serve`: every service as a supervised child process with an embedded valkey."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from voltserve.cli import command as voltserve_command

from .conftest import free_port


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid` (from /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _command(cmdline: str) -> str:
    """The voltserve command a child runs (`... -m voltserve.cli executor ...` -> executor)."""
    words = cmdline.split()
    return words[words.index("voltserve.cli") + 1]


def get(url: str, timeout: float = 2) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def complete(base: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_serve_restarts_a_dead_executor_and_stops_cleanly(tiny_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [*voltserve_command(), "serve", "--model", str(tiny_model)]
        + ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
        + ["--device", "cpu", "--num-kv-blocks", "128", "--heartbeat-ttl", "2"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: get(base + "/health")[0] == 200, 120, "/health")
        first = complete(base, [5, 6, 7, 8, 9])
        assert first["usage"]["completion_tokens"] == 5
        kids = children(proc.pid)
        names = sorted(_command(c) for c in kids.values() if "voltserve.cli" in c)
        assert names == ["executor", "gateway", "renderer", "scheduler"], kids
        assert any("valkey" in c for c in kids.values()), kids  # the embedded server
        (exec_pid,) = [p for p, c in kids.items() if " executor " in c]
        os.kill(exec_pid, signal.SIGKILL)
        # The launcher notices, says so loudly, and starts a new executor.
        wait_until(
            lambda: any(" executor " in c for p, c in children(proc.pid).items() if p != exec_pid),
            30,
            "a restarted executor",
        )
        wait_until(lambda: get(base + "/health")[0] == 200, 120, "/health after the restart")
        assert complete(base, [5, 6, 7, 8, 9])["choices"] == first["choices"]
        text = (tmp_path / "serve.log").read_text()
        assert "DIED UNEXPECTEDLY" in text and "executor-0" in text
        kids = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # Every child is gone (the launcher waited for each: no orphans, no zombies).
        wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in kids), 10, "children")
    finally:
        if proc.poll() is None:
            proc.kill()
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
