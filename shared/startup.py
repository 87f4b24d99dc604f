"""Start-up of a service: its timed phases and how it fails.

Phases (weight loading, kernel compilation, KV cache sizing, CUDA graph capture) are timed, and
each logs one line when it ends ("start-up: <phase> took <s> s", plus what it did), which
`setup_logging` shows at the default log level; long loops inside a phase show a tqdm bar on
stderr.

A start-up failure that retrying will not fix (a missing or malformed model, an unsupported
architecture or quantization, a bad flag, too little memory for one sequence) ends the process
with FATAL_EXIT_CODE after printing the reason on stderr (and into the file named by
$VOLTSERVE_STARTUP_ERROR_FILE, which `voltserve serve` sets for each child): the launcher then
stops instead of restarting the service, and repeats the reason.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger("voltserve.startup")
T = TypeVar("T")

# EX_CONFIG (sysexits.h): the service's configuration or input is wrong; restarting won't help.
FATAL_EXIT_CODE = 78
ERROR_FILE_ENV = "VOLTSERVE_STARTUP_ERROR_FILE"


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    detail: str = ""  # set by the phase's body; appended to its log line


@contextmanager
def phase(name: str, timings: dict[str, float] | None = None) -> Iterator[Phase]:
    """Times the block; logs "start-up: NAME took S s (DETAIL)" at INFO when it ends, and
    records the time in `timings` under NAME."""
    p = Phase(name)
    logger.debug("start-up: %s ...", name)
    t0 = time.perf_counter()
    try:
        yield p
    finally:
        p.seconds = time.perf_counter() - t0
        if timings is not None:
            timings[name] = p.seconds
    logger.info("start-up: %s took %.2f s%s", name, p.seconds, f" ({p.detail})" if p.detail else "")


def progress(
    items: Iterable[T], desc: str, total: int | None = None, unit: str = "it"
) -> Iterable[T]:
    """A tqdm bar on stderr, refreshed at most every 2 s (also readable in container logs)."""
    return tqdm(items, desc=desc, total=total, unit=unit, mininterval=2.0, leave=False)


def freeze_heap() -> int:
    """Moves every object alive at the end of start-up (imported modules, the model, tokenizers,
    compiled kernels, captured graphs) into the collector's permanent generation, and returns how
    many. Those objects live as long as the process, yet every full collection walked them all:
    with torch imported that is ~100 ms on a 2-core CPU, and at 256 running requests one such
    pass stopped the executor for a 182 ms step among 19 ms decode steps (BENCHMARKS.md §3).
    Called once by each service after its start-up, where it owns the process."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.debug(
        "start-up: %d objects out of the collector's passes (%.2f s)", n, time.perf_counter() - t0
    )
    return n


# ---------------------------------------------------------------------------------------------
# Failing


class StartupError(RuntimeError):
    """A start-up failure that retrying will not fix; the message says what to change."""


def is_permanent(e: BaseException) -> bool:
    """Whether a start-up exception will recur on every retry: bad input or configuration
    (ValueError covers the loaders' errors), a missing file, an unsupported feature, too little
    memory. Anything else (a CUDA error, a crash in a library) may be transient."""
    if isinstance(e, StartupError | ValueError | NotImplementedError):
        return True
    if isinstance(e, FileNotFoundError | NotADirectoryError | IsADirectoryError | PermissionError):
        return True
    try:
        import torch

        return isinstance(e, torch.OutOfMemoryError)
    except ImportError:  # the gateway and renderer need no torch
        return False


def fail(service: str, e: BaseException) -> None:
    """Print why `service` cannot start on stderr (and into $VOLTSERVE_STARTUP_ERROR_FILE), then
    exit with FATAL_EXIT_CODE."""
    msg = str(e).strip() or type(e).__name__
    if _is_oom(e):
        msg = (
            f"out of GPU memory while starting: {msg.splitlines()[0]} (lower --max-model-len or "
            "--max-num-batched-tokens, or raise --gpu-memory-utilization)"
        )
    logger.debug("start-up failure of %s", service, exc_info=e)
    print(f"voltserve {service}: cannot start: {msg}", file=sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(msg)
        except OSError:
            pass
    logging.shutdown()
    sys.exit(FATAL_EXIT_CODE)


def _is_oom(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


@contextmanager
def fatal_errors(service: str, also: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Around a service's start-up: a permanent failure (is_permanent, or one of `also`) ends
    the process with FATAL_EXIT_CODE and its message; any other exception propagates."""
    try:
        yield
    except Exception as e:
        if is_permanent(e) or isinstance(e, also):
            fail(service, e)
        raise


def read_error_file(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
