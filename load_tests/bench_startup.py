"""Start-up benchmark: seconds from launching `voltserve serve` to its first healthy /health, for
one model folder, with a cold kernel cache, a warm one, and the cache off (what start-up cost
before the cache: every kernel compiled, one at a time: the anchor), each with the executor's
per-phase times read from its log ("start-up: <phase> took <s> s").

    python load_tests/bench_startup.py --model-dir /tmp/voltserve-llama3-8b --out startup.json
    python load_tests/bench_startup.py --preset qwen2.5-0.5b --model-dir /tmp/q05 --runs cold,warm

Runs (--runs, in order): cold = an empty cache folder; warm = the folder the cold run filled;
nocache = VOLTSERVE_KERNEL_CACHE=0 and one compile job. Each run's folder is fresh for this
benchmark (never the user's cache). Weights come from the page cache in every run: the weight
files are read once before the first run. The JSON is rewritten after every run, so a run cut
short by a time limit keeps the ones before it. Extra `voltserve serve` flags go after `--`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import (  # noqa: E402
    PRESETS,
    checkpoint_matches,
    env_info,
    resolve_dtype,
    write_json,
    write_random_checkpoint,
)
from voltserve.cli import command as voltserve_command  # noqa: E402

logger = logging.getLogger("bench_startup")

PHASE_RE = re.compile(
    r"start-up: (?P<name>[a-zA-Z ]+?) took (?P<s>[0-9.]+) s(?: \((?P<d>[^)]*)\))?"
)
READY_RE = re.compile(r"start-up: engine ready in (?P<s>[0-9.]+) s")
# The phases that held kernel compilation before the cache (one phase then).
COMPILE_PHASES = ("compiling kernels", "capturing CUDA graphs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_files_once(model_dir: Path) -> float:
    """Read every weight file once (into the page cache); seconds taken."""
    t0 = time.perf_counter()
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def parse_log(text: str) -> dict[str, Any]:
    phases: dict[str, float] = {}
    details: dict[str, str] = {}
    for m in PHASE_RE.finditer(text):
        phases[m["name"]] = float(m["s"])
        if m["d"]:
            details[m["name"]] = m["d"]
    ready = READY_RE.search(text)
    out: dict[str, Any] = {"phases_s": phases, "details": details}
    out["engine_ready_s"] = float(ready["s"]) if ready else None
    out["compile_and_capture_s"] = sum(phases.get(p, 0.0) for p in COMPILE_PHASES)
    return out


def one_run(
    kind: str, model_dir: Path, cache_dir: Path, serve_args: list[str], log: Path, timeout: float
) -> dict[str, Any]:
    env = dict(os.environ)
    env["VOLTSERVE_CACHE_DIR"] = str(cache_dir)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if kind == "nocache":
        env["VOLTSERVE_KERNEL_CACHE"] = "0"
        env["VOLTSERVE_COMPILE_JOBS"] = "1"
    port = free_port()
    cmd = [*voltserve_command(), "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *serve_args]
    logger.info("%s run: %s (log %s)", kind, " ".join(cmd), log)
    result: dict[str, Any] = {"kind": kind, "cache_dir": str(cache_dir), "log": str(log)}
    with open(log, "w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            ready = None
            while time.perf_counter() - t0 < timeout:
                if proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            ready = time.perf_counter() - t0
                            break
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.2)
            result["ready_s"] = ready
            result["exit_code"] = proc.poll()
        finally:
            _stop(proc)
    text = log.read_text(errors="replace")
    result.update(parse_log(text))
    if result["ready_s"] is None:
        result["error"] = "not ready: " + " | ".join(text.strip().splitlines()[-8:])
    entries = list((cache_dir / "kernels").rglob("*.vsk")) if cache_dir.exists() else []
    result["cache_entries"] = len(entries)
    result["cache_bytes"] = sum(e.stat().st_size for e in entries)
    return result


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["kind"]: r for r in runs}
    s: dict[str, Any] = {}
    for kind, r in by.items():
        s[f"{kind}_ready_s"] = r.get("ready_s")
        s[f"{kind}_compile_and_capture_s"] = r.get("compile_and_capture_s")
    warm, cold, base = by.get("warm"), by.get("cold"), by.get("nocache")
    if warm and base and warm.get("compile_and_capture_s"):
        s["compile_and_capture_speedup_warm_vs_nocache"] = (
            base["compile_and_capture_s"] / warm["compile_and_capture_s"]
        )
    if cold and base and cold.get("ready_s") and base.get("ready_s"):
        s["cold_vs_nocache_ready_ratio"] = cold["ready_s"] / base["ready_s"]
    return s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", required=True, help="checkpoint folder (written for --preset)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="write a random checkpoint if absent")
    p.add_argument("--runs", default="cold,warm,nocache", help="comma-separated: cold,warm,nocache")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run to get ready")
    p.add_argument("--work-dir", default=None, help="cache folders and logs (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    model_dir = Path(args.model_dir)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {"benchmark": "startup", "env": env_info(device), "args": vars(args)}
    result["serve_args"] = serve_args
    if args.preset and not checkpoint_matches(model_dir, args.preset):
        t = time.perf_counter()
        write_random_checkpoint(model_dir, args.preset, device, resolve_dtype("float16", device))
        result["checkpoint_write_s"] = time.perf_counter() - t
    result["model_dir"] = str(model_dir)
    result["page_cache_read_s"] = read_files_once(model_dir)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="voltserve-bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"  # cold fills it, warm reads it
    shutil.rmtree(cache, ignore_errors=True)
    runs: list[dict[str, Any]] = []
    result["runs"] = runs
    rc = 0
    for kind in [k.strip() for k in args.runs.split(",") if k.strip()]:
        if kind not in ("cold", "warm", "nocache"):
            raise SystemExit(f"unknown run {kind!r}")
        cache_dir = work / "nocache-cache" if kind == "nocache" else cache
        if kind == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        r = one_run(
            kind, model_dir, cache_dir, serve_args, work / f"serve_{kind}.log", args.timeout
        )
        runs.append(r)
        logger.info(
            "%s: ready in %s s; phases %s; compile: %s",
            kind,
            r.get("ready_s") and f"{r['ready_s']:.1f}",
            {k: round(v, 1) for k, v in r["phases_s"].items()},
            r["details"].get("compiling kernels"),
        )
        if r.get("ready_s") is None:
            rc = 1
        result["summary"] = summarize(runs)
        write_json(args.out, result)
    print(result.get("summary"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
