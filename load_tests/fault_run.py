"""Fault run: the soak's mixed traffic while executors are killed with SIGKILL every ~30 s and
restarted by `voltserve serve`'s supervisor. The scheduler must fail their requests over to a
live executor: no request may be lost (each completes or fails with a clear error). JSON summary
as soak.py's, plus every kill and how long the executor took to come back.

    .venv/bin/python load_tests/fault_run.py --minutes 5 --out load_tests/results/fault_cpu.json

Starts its own stack (demo model, CPU, 2 executors by default, loopback only): it needs the pids.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.serve_stack import ServeStack  # noqa: E402
from load_tests.soak import add_common_flags, run  # noqa: E402


def chaos_factory(interval_s: float, seed: int, max_kills: int):
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
                execs = {n: p for n, p in stack.services().items() if n.startswith("executor:")}
                if not execs:
                    kills.append({"t": time.time(), "error": "no executor running"})
                    continue
                name = rng.choice(sorted(execs))
                pid = execs[name]
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                back = None
                # Bounded wait for the supervisor to restart it (a new pid under the same name).
                while time.monotonic() - t0 < 60 and not stop.is_set():
                    now = stack.services().get(name)
                    if now is not None and now != pid:
                        back = round(time.monotonic() - t0, 2)
                        break
                    await asyncio.sleep(0.2)
                kills.append({"executor": name, "pid": pid, "restarted_after_s": back})
            return {"kills": kills, "num_kills": len(kills), "interval_s": interval_s}

        return chaos

    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--kill-interval", type=float, default=30.0, help="seconds between kills")
    p.set_defaults(executors=2)
    args = p.parse_args()
    if args.url:
        p.error("fault_run.py starts its own stack (it kills its executors); drop --url")
    max_kills = int(args.minutes * 60 / args.kill_interval) + 2
    sys.exit(run(args, "fault", chaos_factory(args.kill_interval, args.seed, max_kills)))


if __name__ == "__main__":
    main()
