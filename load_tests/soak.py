"""Soak run: N minutes of mixed traffic (chat and completions, streaming and not, random prompt
lengths and max_tokens, some stop strings, some clients that disconnect mid-stream), then checks
that nothing leaked: every request ended well (lost == 0), every service's RSS is flat (first vs
last minute), every executor is idle with every KV block free.

    .venv/bin/python load_tests/soak.py --minutes 5 --out load_tests/results/soak_cpu.json

Without --url it starts `voltserve serve` itself with the demo model on CPU (loopback only).
With --url it drives an existing stack; give --redis-url too for the KV check (RSS needs a
stack it started). Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.serve_stack import (  # noqa: E402
    REPO_ROOT,
    ServeStack,
    ensure_demo_model,
    executor_statuses,
    http_json,
    metric_sum,
    scrape,
)
from load_tests.traffic import kv_all_free, rss_flat, run_traffic  # noqa: E402


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=1_000_000, help="hard cap on requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="drive this stack instead of starting one")
    p.add_argument("--redis-url", default=None, help="with --url: for the KV-blocks check")
    p.add_argument("--model", default=None, help="checkpoint for the stack it starts")
    p.add_argument("--executors", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--out", default=None, help="JSON summary path")
    p.add_argument("--workdir", default=None)


async def sample_rss(stack: ServeStack | None, stop: asyncio.Event, every_s: float, out: list):
    while stack is not None and not stop.is_set():
        out.append((time.monotonic(), stack.rss()))
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except TimeoutError:
            pass


def wait_idle(redis_url: str | None, expected: int | None, timeout_s: float = 120.0) -> dict:
    """Bounded wait until every executor (all `expected` of them alive, e.g. after a restart)
    is idle with every KV block free."""
    if redis_url is None:
        return {"ok": None, "reason": "no Redis URL"}
    deadline = time.monotonic() + timeout_s
    while True:
        res = kv_all_free(executor_statuses(redis_url))
        if expected is not None and len(res["executors"]) < expected:
            res["ok"] = False
            res["reason"] = f"{len(res['executors'])} of {expected} executors alive"
        if res["ok"] or time.monotonic() > deadline:
            return res
        time.sleep(1.0)


def start_stack(args: argparse.Namespace, workdir: Path) -> ServeStack:
    model = Path(args.model) if args.model else ensure_demo_model(workdir / "demo-model")
    extra = ["--device", "cpu", "--executors", str(args.executors)]
    extra += ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "32"]
    stack = ServeStack(model, workdir, extra)
    stack.start()
    return stack


async def drive(args: argparse.Namespace, url: str, model: str, stack: ServeStack | None, chaos):
    """Traffic (plus RSS sampling and the optional chaos task) for args.minutes."""
    rss: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(stack, stop, 5.0, rss))
    chaos_task = asyncio.create_task(chaos(stop)) if chaos else None
    t0 = time.monotonic()
    stats = await run_traffic(
        url, model, args.minutes * 60, args.concurrency, args.seed, args.max_requests
    )
    elapsed = time.monotonic() - t0
    stop.set()
    await sampler
    chaos_result = await chaos_task if chaos_task else None
    return stats, rss, elapsed, chaos_result


def finish(args, name, stats, rss, elapsed, url, redis_url, stack, extra: dict) -> int:
    summary: dict[str, Any] = {"run": name, "minutes": args.minutes, "elapsed_s": round(elapsed, 1)}
    summary["concurrency"] = args.concurrency
    summary.update(stats.summary())
    idle = wait_idle(redis_url, args.executors if stack is not None else None)
    summary["kv_blocks_all_free"] = idle
    summary["rss"] = rss_flat(rss) if stack is not None else {"flat": None, "reason": "--url"}
    try:
        m = scrape(url)
        summary["gateway_metrics"] = {
            r: metric_sum(m, "vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort")
        }
        summary["gateway_metrics"]["generation_tokens_total"] = metric_sum(
            m, "vllm:generation_tokens_total"
        )
    except OSError as e:
        summary["gateway_metrics"] = {"error": str(e)}
    summary.update(extra)
    checks = {
        "lost_is_zero": summary["lost"] == 0,
        "some_completed": summary["completed"] > 0,
        "kv_blocks_all_free": idle["ok"] is not False,
        "rss_flat": summary["rss"]["flat"] is not False,
    }
    if "ok" in extra.get("chaos", {}):
        checks["chaos_recovered"] = extra["chaos"]["ok"]
    summary["checks"] = checks
    summary["passed"] = all(checks.values())
    text = __import__("json").dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if summary["passed"] else 1


def run(args: argparse.Namespace, name: str, chaos_factory=None) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"voltserve-{name}-"))
    stack = None
    try:
        if args.url:
            url, redis_url = args.url.rstrip("/"), args.redis_url
        else:
            stack = start_stack(args, workdir)
            url, redis_url = stack.url, stack.redis_url
        _, models = http_json(url + "/v1/models")
        model = models["data"][0]["id"]
        chaos = chaos_factory(stack) if chaos_factory else None
        stats, rss, elapsed, chaos_result = asyncio.run(drive(args, url, model, stack, chaos))
        extra = {"chaos": chaos_result} if chaos_result is not None else {}
        extra["stack"] = "external" if args.url else f"voltserve serve (CPU, log {stack.log_path})"
        return finish(args, name, stats, rss, elapsed, url, redis_url, stack, extra)
    finally:
        if stack is not None:
            stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    sys.exit(run(p.parse_args(), "soak"))


if __name__ == "__main__":
    _ = REPO_ROOT
    main()
