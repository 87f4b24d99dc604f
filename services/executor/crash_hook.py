"""A fault for tests only: with VOLTSERVE_TEST_CRASH_ON_TOKENS=<id,id,...> set, the engine loop
raises when a request whose prompt holds that token sequence reaches it, as a crash of the
engine would (the executor exits and its supervisor restarts it). The crash-loop guard
(services/scheduler/failover.py) is tested with it. Unset, as it always is outside tests,
nothing happens."""

from __future__ import annotations

import os

ENV = "VOLTSERVE_TEST_CRASH_ON_TOKENS"


def crash_marker() -> tuple[int, ...]:
    raw = os.environ.get(ENV, "").strip()
    return tuple(int(x) for x in raw.split(",")) if raw else ()


def holds(prompt: list[int], marker: tuple[int, ...]) -> bool:
    n = len(marker)
    return any(tuple(prompt[i : i + n]) == marker for i in range(len(prompt) - n + 1))
