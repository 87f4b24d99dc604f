"""Start-up phases (weight loading, KV cache sizing, kernel compilation, CUDA graph capture):
each is timed and logged, so an operator watching a slow start sees where the time goes. Long
loops inside a phase show a tqdm bar on stderr."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger("voltserve.startup")
T = TypeVar("T")

# Phases at least this long are logged at WARNING (visible at the default log level).
SLOW_PHASE_S = 2.0


@contextmanager
def phase(name: str) -> Iterator[None]:
    logger.info("start-up: %s ...", name)
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    level = logging.WARNING if dt >= SLOW_PHASE_S else logging.INFO
    logger.log(level, "start-up: %s took %.2f s", name, dt)


def progress(
    items: Iterable[T], desc: str, total: int | None = None, unit: str = "it"
) -> Iterable[T]:
    """A tqdm bar on stderr, refreshed at most every 2 s (also readable in container logs)."""
    return tqdm(items, desc=desc, total=total, unit=unit, mininterval=2.0, leave=False)
