"""Shared pieces of the numba.cuda kernels: block reductions, storage-dtype rounding, float bits
and keys, and the cheap path from torch tensors to a numba launch on torch's current stream.

Every device helper has two bodies. On a GPU (and when compiling for a compute capability without
one) the reductions use warp shuffles; in numba's CUDA simulator, which has no shuffles, they use
shared memory and barriers. Both reduce in a fixed order, so a kernel's result depends only on its
inputs and its block size, never on timing.

Block reductions take a 32-element shared scratch array of the value's type (one slot per warp),
which the kernel allocates, and must be reached by every thread of the block.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64
from numba import uint64 as numba_uint64
from numba.core.types import float16
from numba.cuda.core import config
from voltserve.kernels.runtime.launch_geometry import check, record, recording_active

SIM: bool = bool(config.ENABLE_CUDASIM)
# An array index as an unsigned integer: numba emits no negative-index wraparound (a compare
# and a select per index and access) for it, so a kernel's inner loops keep immediate offsets.
# In the simulator a plain int (numpy's unsigned scalars would make its Python loops slower).
uidx: Any = int if SIM else numba_uint64
# Latency-bound kernels (batch-1 decode: one wave of a few dozen blocks) launch small grids on
# purpose; numba's low-occupancy warning fired for them on every numba launch, filling the logs.
config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)

if SIM:

    @cuda.jit(device=True)
    def block_sum(v, scratch):
        # Warps take turns writing their 32 lanes; every thread then sums them in lane order.
        tid, bd = cuda.threadIdx.x, cuda.blockDim.x
        total = v - v
        base = 0
        while base < bd:
            cuda.syncthreads()
            if base <= tid < base + 32:
                scratch[tid - base] = v
            cuda.syncthreads()
            for j in range(min(32, bd - base)):
                total += scratch[j]
            base += 32
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def block_sum2(u, v, scratch2):
        tid, bd = cuda.threadIdx.x, cuda.blockDim.x
        tu, tv = u - u, v - v
        base = 0
        while base < bd:
            cuda.syncthreads()
            if base <= tid < base + 32:
                scratch2[0, tid - base] = u
                scratch2[1, tid - base] = v
            cuda.syncthreads()
            for j in range(min(32, bd - base)):
                tu += scratch2[0, j]
                tv += scratch2[1, j]
            base += 32
        cuda.syncthreads()
        return tu, tv

    @cuda.jit(device=True)
    def block_max(v, scratch):
        tid, bd = cuda.threadIdx.x, cuda.blockDim.x
        best = v
        base = 0
        while base < bd:
            cuda.syncthreads()
            if base <= tid < base + 32:
                scratch[tid - base] = v
            cuda.syncthreads()
            for j in range(min(32, bd - base)):
                if scratch[j] > best:
                    best = scratch[j]
            base += 32
        cuda.syncthreads()
        return best

    @cuda.jit(device=True)
    def block_argmax(v, i, scratch_v, scratch_i):
        """(max value, lowest index holding it); NaNs never win."""
        tid, bd = cuda.threadIdx.x, cuda.blockDim.x
        best_v, best_i = v, i
        base = 0
        while base < bd:
            cuda.syncthreads()
            if base <= tid < base + 32:
                scratch_v[tid - base] = v
                scratch_i[tid - base] = i
            cuda.syncthreads()
            for j in range(min(32, bd - base)):
                ov, oi = scratch_v[j], scratch_i[j]
                if ov > best_v or (ov == best_v and oi < best_i) or best_v != best_v:
                    if ov == ov:
                        best_v, best_i = ov, oi
            base += 32
        cuda.syncthreads()
        return best_v, best_i

    @cuda.jit(device=True)
    def float_bits(x):
        """The bits of fp32 value x as an int32."""
        return np.float32(x).view(np.int32)

    @cuda.jit(device=True)
    def float_key(x):
        """Monotone map of an fp32 value to [0, 2^32) (int64); -0.0 and +0.0 share a key."""
        b = np.int64(np.float32(x).view(np.int32))
        if b >= 0:
            return b + 2147483648
        return 2147483648 - (b & 0x7FFFFFFF)

else:

    @cuda.jit(device=True, inline="always")
    def block_sum(v, scratch):
        tid = cuda.threadIdx.x
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        cuda.syncthreads()  # the previous reduction's readers are done with scratch
        if (tid & 31) == 0:
            scratch[tid >> 5] = v
        cuda.syncthreads()
        total = scratch[0]
        for w in range(1, (cuda.blockDim.x + 31) >> 5):
            total += scratch[w]
        return total

    @cuda.jit(device=True, inline="always")
    def block_sum2(u, v, scratch2):
        """(block_sum(u), block_sum(v)) with one exchange: scratch2 is [2, 32] shared."""
        tid = cuda.threadIdx.x
        off = 16
        while off > 0:
            u += cuda.shfl_xor_sync(FULL_MASK, u, off)
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        cuda.syncthreads()  # the previous reduction's readers are done with scratch2
        if (tid & 31) == 0:
            scratch2[0, tid >> 5] = u
            scratch2[1, tid >> 5] = v
        cuda.syncthreads()
        tu = scratch2[0, 0]
        tv = scratch2[1, 0]
        for w in range(1, (cuda.blockDim.x + 31) >> 5):
            tu += scratch2[0, w]
            tv += scratch2[1, w]
        return tu, tv

    @cuda.jit(device=True, inline="always")
    def block_max(v, scratch):
        tid = cuda.threadIdx.x
        off = 16
        while off > 0:
            o = cuda.shfl_xor_sync(FULL_MASK, v, off)
            if o > v:
                v = o
            off >>= 1
        cuda.syncthreads()
        if (tid & 31) == 0:
            scratch[tid >> 5] = v
        cuda.syncthreads()
        best = scratch[0]
        for w in range(1, (cuda.blockDim.x + 31) >> 5):
            if scratch[w] > best:
                best = scratch[w]
        return best

    @cuda.jit(device=True, inline="always")
    def block_argmax(v, i, scratch_v, scratch_i):
        """(max value, lowest index holding it); NaNs never win."""
        tid = cuda.threadIdx.x
        off = 16
        while off > 0:
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov == ov and (ov > v or (ov == v and oi < i) or v != v):
                v, i = ov, oi
            off >>= 1
        cuda.syncthreads()
        if (tid & 31) == 0:
            scratch_v[tid >> 5] = v
            scratch_i[tid >> 5] = i
        cuda.syncthreads()
        best_v, best_i = scratch_v[0], scratch_i[0]
        for w in range(1, (cuda.blockDim.x + 31) >> 5):
            ov, oi = scratch_v[w], scratch_i[w]
            if ov == ov and (ov > best_v or (ov == best_v and oi < best_i) or best_v != best_v):
                best_v, best_i = ov, oi
        return best_v, best_i

    @cuda.jit(device=True, inline="always")
    def float_bits(x):
        """The bits of fp32 value x as an int32."""
        return cuda.libdevice.float_as_int(float32(x))

    @cuda.jit(device=True, inline="always")
    def float_key(x):
        """Monotone map of an fp32 value to [0, 2^32) (int64); -0.0 and +0.0 share a key."""
        b = int64(cuda.libdevice.float_as_int(x))
        if b >= 0:
            return b + 2147483648
        return 2147483648 - (b & 0x7FFFFFFF)


def _round_like_py(v: Any, arr: Any) -> Any:
    return float32(arr.dtype.type(v))


if SIM:
    round_like = cuda.jit(device=True)(_round_like_py)
else:
    from numba.extending import overload

    def round_like(v, arr):  # noqa: D103 - typed by the overload below
        raise NotImplementedError("round_like is only callable from a kernel")

    @overload(round_like, target="cuda")
    def _round_like_cuda(v, arr):
        """fp32 value rounded through arr's storage dtype (identity for fp32 storage)."""
        if arr.dtype == float16:
            return lambda v, arr: float32(float16(v))
        return lambda v, arr: float32(v)


# ---------------------------------------------------------------------------------------------
# Host side: torch tensors -> numba launches on torch's current stream.

_streams: dict[int, Any] = {}  # torch stream handle -> numba external stream (a cache, no state)


def current_stream() -> Any:
    """numba's view of torch's current CUDA stream, created once per torch stream (None inside
    a launch recording, which runs nothing)."""
    if recording_active():
        return None
    import torch

    handle = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = cuda.external_stream(handle) if handle else cuda.default_stream()
        _streams[handle] = stream
    return stream


def named_kernel(fn: Any, module: str, name: str) -> Any:
    """A kernel function from generated source, named for profiles: exec'd functions belong to
    no module, so numba mangles every one of them as `<dynamic>::kernel` and a profile cannot
    tell a GEMV from an attention kernel. Names only: the generated code is the same."""
    fn.__module__ = module
    fn.__name__ = fn.__qualname__ = name
    return fn


def nvvm_inlined(fn: Any) -> Any:
    """The device function `fn` (declared `inline="always"`) recompiled to be inlined by NVVM
    (`forceinline`) instead of by numba's IR inliner. Numba re-runs its liveness analysis over
    the whole caller once per inlined call, so a written-out kernel with hundreds of helper calls
    spends minutes in numba's front end (the plain GEMV for 8 rows: 57 s -> 11 s on one core).
    Only for callers whose cc 7.0 PTX was checked to be the same instructions either way (the
    inliners' pass orders differ, and for some kernels so does the register allocation). The
    simulator has no such option and runs `fn` as it is."""
    if SIM:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn.py_func)


def launch(kernel: Any, grid: Any, block: Any, args: tuple, stream: Any = None) -> None:
    """kernel[grid, block, stream](*args) with torch CUDA tensors as array arguments.

    The geometry is checked first (launch_geometry.check: a grid or block past the CUDA limits
    raises LaunchGeometryError naming the kernel and the dimension, here and in the simulator);
    inside a launch_geometry.recording() the launch is recorded and not run. After the first
    launch of a kernel with an argument signature, fast_launch.LAUNCHER launches it without
    numba's per-launch argument handling (see fast_launch.py); until then, and for kernels it
    has no plan for, tensors are wrapped as numba device arrays without a stream sync (graph-
    capture safe) and numba launches. Tests call this with numpy arrays in the simulator."""
    grid, block = check(kernel, grid, block)
    if record(kernel, grid, block, args):
        return
    if SIM:
        kernel[grid, block](*args)
        return
    import torch
    from voltserve.kernels.runtime.fast_launch import LAUNCHER

    if LAUNCHER.launch(kernel, grid, block, args, stream):
        return
    nargs = tuple(
        cuda.as_cuda_array(a.detach(), sync=False) if isinstance(a, torch.Tensor) else a
        for a in args
    )
    if stream is None:
        kernel[grid, block](*nargs)
    else:
        kernel[grid, block, stream](*nargs)
    LAUNCHER.learn(kernel, args, nargs)


def block_for(n: int, per_thread: int, lo: int = 32, hi: int = 1024) -> int:
    """A block size (multiple of 32) giving each thread about per_thread of n items."""
    want = (n + per_thread - 1) // per_thread
    return max(lo, min(hi, (want + 31) // 32 * 32))


__all__ = [
    "SIM",
    "uidx",
    "block_sum2",
    "nvvm_inlined",
    "block_argmax",
    "block_max",
    "block_sum",
    "float_key",
    "round_like",
    "current_stream",
    "launch",
    "block_for",
    "float16",
    "float32",
    "int32",
    "int64",
]
