"""Fault run: the soak's mixed traffic while parts of `voltserve serve` are killed with SIGKILL
every ~30 s and restarted by its supervisor: an executor (`--kill executor`, the default; the
scheduler fails its requests over to a live one), the embedded message broker (`--kill broker`;
it comes back on the same port from its append-only file while the services wait for it), or
each in turn (`--kill both`). No request may be lost (each completes or fails with a clear
error). JSON summary as soak.py's, plus every kill: what was killed, how long its supervisor
took to have it running again, and how long until a new request was served again.

    .venv/bin/python load_tests/fault_run.py --minutes 5 --out load_tests/results/fault_cpu.json
    .venv/bin/python load_tests/fault_run.py --minutes 2 --kill broker --out fault_broker.json

Starts its own stack (demo model, CPU, 2 executors by default, loopback only): it needs the pids.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import time

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.serve_stack import ServeStack, http_json  # noqa: E402
from load_tests.soak import add_common_flags, run  # noqa: E402

RECOVERY_LIMIT_S = 60.0


async def served_after(stack: ServeStack, t0: float, stop: asyncio.Event) -> float | None:
    """Seconds from t0 until a new one-token request is answered 200 (None past the limit)."""
    body = {"model": stack.model_name, "prompt": "recovery probe", "max_tokens": 1}
    while time.monotonic() - t0 < RECOVERY_LIMIT_S and not stop.is_set():
        try:
            status, _ = await asyncio.to_thread(http_json, stack.url + "/v1/completions", body, 5.0)
        except (OSError, ValueError):
            status = 0
        if status == 200:
            return round(time.monotonic() - t0, 2)
        await asyncio.sleep(0.2)
    return None


async def restarted_after(pid_now, old: int | None, t0: float, stop: asyncio.Event):
    """Seconds from t0 until pid_now() names a new process (None past the limit)."""
    while time.monotonic() - t0 < RECOVERY_LIMIT_S and not stop.is_set():
        now = pid_now()
        if now is not None and now != old:
            return round(time.monotonic() - t0, 2)
        await asyncio.sleep(0.05)
    return None


async def kill_executor(stack: ServeStack, rng: random.Random, stop: asyncio.Event) -> dict:
    execs = {n: p for n, p in stack.services().items() if n.startswith("executor:")}
    if not execs:
        return {"target": "executor", "t": time.time(), "error": "no executor running"}
    name = rng.choice(sorted(execs))
    pid = execs[name]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    back = await restarted_after(lambda: stack.services().get(name), pid, t0, stop)
    return {"target": "executor", "executor": name, "pid": pid, "restarted_after_s": back}


async def kill_broker(stack: ServeStack, stop: asyncio.Event) -> dict:
    pid = stack.broker_pid()
    if pid is None:
        return {"target": "broker", "t": time.time(), "error": "no embedded broker running"}
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    back = await restarted_after(stack.broker_pid, pid, t0, stop)
    served = await served_after(stack, t0, stop)
    return {"target": "broker", "pid": pid, "restarted_after_s": back, "served_after_s": served}


def recovery(kills: list[dict]) -> dict:
    """Per target and measure: median and max seconds, and how many kills never got there."""
    out = {}
    for target in ("executor", "broker"):
        mine = [k for k in kills if k.get("target") == target and "error" not in k]
        for key in ("restarted_after_s", "served_after_s"):
            xs = [k[key] for k in mine if key in k]
            done = [x for x in xs if x is not None]
            if xs:
                out[f"{target}_{key}"] = {
                    "median": statistics.median(done) if done else None,
                    "max": max(done) if done else None,
                    "not_recovered": len(xs) - len(done),
                }
    return out


def chaos_factory(interval_s: float, seed: int, max_kills: int, kill: str):
    def make(stack: ServeStack | None):
        if stack is None:
            raise SystemExit("fault_run.py starts its own stack; --url is not supported")

        async def chaos(stop: asyncio.Event) -> dict:
            rng = random.Random(seed + 1)
            kills: list[dict] = []
            while not stop.is_set() and len(kills) < max_kills:
                try:
                    await asyncio.wait_for(stop.wait(), rng.uniform(0.7, 1.3) * interval_s)
                    break
                except TimeoutError:
                    pass
                target = kill if kill != "both" else ("executor", "broker")[len(kills) % 2]
                if target == "broker":
                    kills.append(await kill_broker(stack, stop))
                else:
                    kills.append(await kill_executor(stack, rng, stop))
            return {
                "kills": kills,
                "num_kills": len(kills),
                "interval_s": interval_s,
                "recovery": recovery(kills),
                # Every kill found its target and everything came back within the limit.
                "ok": bool(kills)
                and all(all(v is not None for v in k.values()) for k in kills)
                and not any("error" in k for k in kills),
            }

        return chaos

    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--kill-interval", type=float, default=30.0, help="seconds between kills")
    p.add_argument(
        "--kill",
        choices=["executor", "broker", "both"],
        default="executor",
        help="what is killed: an executor, the embedded broker, or each in turn",
    )
    p.set_defaults(executors=2)
    args = p.parse_args()
    if args.url:
        p.error("fault_run.py starts its own stack (it kills its executors); drop --url")
    max_kills = int(args.minutes * 60 / args.kill_interval) + 2
    chaos = chaos_factory(args.kill_interval, args.seed, max_kills, args.kill)
    sys.exit(run(args, "fault", chaos))


if __name__ == "__main__":
    main()
