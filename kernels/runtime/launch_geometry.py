"""Launch geometry: the CUDA limits every kernel launch must respect, the check that
`numba_common.launch` applies to each launch (on a GPU and in numba's simulator alike), the one
function that places a count that may pass a grid dimension's limit, and a recording mode for
tests.

Limits (every compute capability from 3.0 on, so V100 through H200): gridDim.x up to 2^31 - 1,
gridDim.y and gridDim.z up to 65,535, every grid dimension at least 1; blockDim.x and .y up to
1,024, .z up to 64, and at most 1,024 threads a block. The driver rejects a launch past any of
them with CUDA_ERROR_INVALID_VALUE, which names neither the kernel nor the dimension, and the
simulator does not check them at all; `check` raises a LaunchGeometryError naming both. Static
shared memory is bounded at compile time (ptxas refuses more than 48 KiB) and no launch here uses
dynamic shared memory, so shared memory needs no check at launch.

Placing a count: gridDim.x takes any count a model has (vocabularies, tokens x heads). A count
that goes on y and can pass 65,535 (a weight's rows: vocabularies reach 262,144) goes through
`fold_yz`, which spreads it over y and z; the kernel's item is `blockIdx.z * gridDim.y +
blockIdx.y` (blocks past the count return at once). Up to 65,535 that is gridDim.z = 1 and the
grid is the unfolded one; the linear block order (x fastest, then y, then z) is the same either
way. Other y / z counts (the batch, heads, tile counts of one prompt) stay far below the limit at
every supported shape; `check` refuses a launch where one does not.

Recording (tests): inside `recording()`, a launch through `numba_common.launch` is checked,
appended to the yielded list as a `Launch` (the kernel's name, grid, block and each argument's
name from the kernel's signature, shape and dtype) and not run. The launchers' device checks
accept torch's 'meta' tensors there (`on_gpu`), `current_stream()` is None and `sm_count` of a
meta tensor's device is the recording's SM count, so the production launchers run on the CPU at
real model shapes in milliseconds, with no memory behind the tensors. Outside a recording a meta
tensor is no GPU tensor: production checks are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65_535
MAX_BLOCK_XY = 1_024
MAX_BLOCK_Z = 64
MAX_THREADS_PER_BLOCK = 1_024
# H100 SXM: the SM count a recording reports unless told otherwise (split-K and partition
# choices depend on it).
RECORDING_SMS = 132

Dim3 = tuple[int, int, int]


class LaunchGeometryError(ValueError):
    """A launch configuration that no CUDA device runs, naming the kernel and the dimension."""


def dim3(d: Any) -> Dim3:
    """(x, y, z) of a launch dimension given as an int or a tuple of up to three ints."""
    if type(d) is int:
        return d, 1, 1
    if isinstance(d, (tuple, list)):
        n = len(d)
        if n == 3:
            return int(d[0]), int(d[1]), int(d[2])
        if n == 2:
            return int(d[0]), int(d[1]), 1
        if n == 1:
            return int(d[0]), 1, 1
        raise LaunchGeometryError(f"a launch dimension has 1 to 3 entries, got {d!r}")
    return int(d), 1, 1


_PACKAGE = "voltserve.kernels."


def kernel_name(kernel: Any) -> str:
    """`module.qualified_name` of a numba kernel's Python function, the module as its dotted path
    inside voltserve.kernels (`attention.decode.<kernel>`, not to be confused with
    `moe.decode.<kernel>`; a kernel elsewhere keeps its full module path). A kernel generated
    from source, which has no module, is named by its source's label. For errors and records."""
    fn = getattr(kernel, "py_func", kernel)
    qual = getattr(fn, "__qualname__", None) or type(kernel).__name__
    module = str(getattr(fn, "__module__", None) or "").removeprefix(_PACKAGE)
    if module:
        return f"{module}.{qual}"
    code = getattr(fn, "__code__", None)
    return f"{qual} {code.co_filename}" if code is not None else qual


def check(kernel: Any, grid: Any, block: Any) -> tuple[Dim3, Dim3]:
    """(grid, block) as (x, y, z) triples, or LaunchGeometryError naming the kernel and the
    first dimension past its limit. Cheap (about a microsecond): it runs on every launch."""
    g = dim3(grid)
    b = dim3(block)
    gx, gy, gz = g
    bx, by, bz = b
    if (
        0 < gx <= MAX_GRID_X
        and 0 < gy <= MAX_GRID_YZ
        and 0 < gz <= MAX_GRID_YZ
        and 0 < bx
        and 0 < by
        and 0 < bz <= MAX_BLOCK_Z
        and bx * by * bz <= MAX_THREADS_PER_BLOCK  # so x and y are within MAX_BLOCK_XY too
    ):
        return g, b
    raise LaunchGeometryError(f"kernel {kernel_name(kernel)}: {_violation(g, b)}")


def _violation(g: Dim3, b: Dim3) -> str:
    limits = (
        ("gridDim", g, (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)),
        ("blockDim", b, (MAX_BLOCK_XY, MAX_BLOCK_XY, MAX_BLOCK_Z)),
    )
    for what, dims, maxima in limits:
        for axis, v, hi in zip("xyz", dims, maxima):
            if v < 1:
                return f"{what}.{axis} = {v} (grid {g}, block {b}): every dimension is at least 1"
            if v > hi:
                return f"{what}.{axis} = {v:,} exceeds the CUDA limit {hi:,} (grid {g}, block {b})"
    threads = b[0] * b[1] * b[2]
    return (
        f"{threads:,} threads per block exceed the CUDA limit {MAX_THREADS_PER_BLOCK:,} (block {b})"
    )


def fold_yz(count: int, limit: int = MAX_GRID_YZ) -> tuple[int, int]:
    """(gridDim.y, gridDim.z) for `count` items on y: (count, 1) up to `limit`, past it `limit`
    rows of blocks in as many z slices as it takes (the kernel's item is blockIdx.z * gridDim.y
    + blockIdx.y; those past count return). `limit` is a parameter so that simulator tests can
    fold at small shapes."""
    if count < 1 or limit < 1:
        raise ValueError(f"fold_yz: count {count} and limit {limit} must be at least 1")
    y = min(count, limit)
    return y, -(-count // y)


# ---------------------------------------------------------------------------------------------
# Recording


@dataclass(frozen=True)
class Arg:
    """One kernel argument of a recorded launch."""

    name: str  # the kernel parameter's name
    shape: tuple[int, ...] | None  # an array's shape; None for a scalar
    dtype: str  # an array's element type, a scalar's Python type
    value: Any = None  # a scalar's value


@dataclass(frozen=True)
class Launch:
    """One launch as `numba_common.launch` received it (after `check`)."""

    kernel: str
    grid: Dim3
    block: Dim3
    args: tuple[Arg, ...]

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.kernel} has no argument {name!r} ({[a.name for a in self.args]})")

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class _Recording:
    launches: list[Launch]
    sms: int


_ACTIVE: _Recording | None = None


def recording_active() -> bool:
    return _ACTIVE is not None


@contextlib.contextmanager
def recording(sms: int = RECORDING_SMS) -> Iterator[list[Launch]]:
    """Inside, launches are checked and recorded, not run (see the module docstring).
    Process-wide: record from one thread, with no real launches going on."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("launch recordings do not nest")
    rec = _Recording([], sms)
    _ACTIVE = rec
    try:
        yield rec.launches
    finally:
        _ACTIVE = None


def record(kernel: Any, grid: Dim3, block: Dim3, args: tuple) -> bool:
    """Append the launch to the active recording: True when one is active (the caller then
    launches nothing). Raises TypeError when the argument count differs from the kernel's."""
    rec = _ACTIVE
    if rec is None:
        return False
    names = _parameters(getattr(kernel, "py_func", kernel))
    if len(names) != len(args):
        raise TypeError(
            f"kernel {kernel_name(kernel)} takes {len(names)} arguments {names}, "
            f"launched with {len(args)}"
        )
    rec.launches.append(
        Launch(kernel_name(kernel), grid, block, tuple(_arg(n, a) for n, a in zip(names, args)))
    )
    return True


@functools.cache
def _parameters(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _arg(name: str, a: Any) -> Arg:
    if isinstance(a, numbers.Number):  # Python and NumPy scalars
        return Arg(name, None, type(a).__name__, a)
    return Arg(name, tuple(int(s) for s in a.shape), str(a.dtype).removeprefix("torch."))


def on_gpu(t: Any) -> bool:
    """Whether tensor t is where the kernels run: a CUDA tensor, or inside a recording a 'meta'
    tensor (shape and dtype only). The launchers' device checks use this."""
    return t.is_cuda or (_ACTIVE is not None and t.is_meta)


@functools.cache
def device_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index`."""
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: Any) -> int:
    """Streaming multiprocessors of a tensor's device (the recording's count for a meta tensor
    inside a recording)."""
    if _ACTIVE is not None and device.type == "meta":
        return _ACTIVE.sms
    return device_sms(device.index or 0)


__all__ = [
    "MAX_GRID_X",
    "MAX_GRID_YZ",
    "MAX_BLOCK_XY",
    "MAX_BLOCK_Z",
    "MAX_THREADS_PER_BLOCK",
    "Arg",
    "Launch",
    "LaunchGeometryError",
    "check",
    "device_sms",
    "dim3",
    "fold_yz",
    "kernel_name",
    "on_gpu",
    "record",
    "recording",
    "recording_active",
    "sm_count",
]
