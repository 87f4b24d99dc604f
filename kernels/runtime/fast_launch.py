"""Kernel launches from torch tensors without numba's per-launch argument handling.

Why: numba's `kernel[grid, block, stream](*args)` wraps every tensor argument in a numba device
array (`cuda.as_cuda_array`: the CUDA array interface, a context check, a MemoryPointer, a
dummy array), types each argument and builds ctypes values, ~150-250 us of host time for a
launch with a few tensors on the H200 host. CUDA-graph replay hides that in decode, but an eager
prefill step makes ~5 such launches a layer: a 512-token prefill of Qwen2.5-0.5B spent 67 ms of
wall time for 2 ms of GPU work (profile_kernels.py --prefill --host-profile; BENCHMARKS.md §1).

How: the first launch of a kernel with a given argument signature goes through numba (which
compiles or loads the kernel and launches it). Afterwards, a `_Plan` for that signature holds
the compiled function's handle and how each argument flattens into kernel parameters, the way
numba's own `_Kernel._prepare_args` does it: an array is (meminfo, parent, nitems, itemsize,
data, shape..., strides in bytes...), a scalar is its typed value. Later launches with the same
signature pack those values into one buffer and call cuLaunchKernel directly on torch's stream.

The signature of a tensor is its dtype, rank and numba layout ('C', 'F' or 'A', computed as
numba computes it: `numba_layout`); of a scalar, its Python type. The plan takes its parameter
types from the compiled kernel's own argument types, so a value is packed as the kernel reads
it. Kernels that numba specialises on the launch configuration, or that are cooperative, debug
or extended, never get a plan and always go through numba. While `compile_cache.traced_launches`
records launches (start-up), `bypass()` sends every launch through numba (which records it and
runs nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# struct codes of numba's scalar kernel parameter types, each padded to an 8-byte slot
_SCALAR_CODES = {
    "int8": "b7x",
    "uint8": "B7x",
    "int16": "h6x",
    "uint16": "H6x",
    "int32": "i4x",
    "uint32": "I4x",
    "int64": "q",
    "uint64": "Q",
    "float16": "e6x",
    "float32": "f4x",
    "float64": "d",
    "bool": "?7x",
}


def numba_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> str:
    """The layout numba gives an array of this shape and byte strides ('C', 'F' or 'A'): numba's
    dummyarray rules (NumPy's contiguity flags: size-1 dims ignored, empty arrays contiguous,
    a zero stride on any dim neither)."""
    if not shape or 0 in shape:
        return "C"
    if 0 in strides:
        return "A"
    c = f = True
    expect = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != expect:
                c = False
                break
            expect *= n
    if c:
        return "C"
    expect = itemsize
    for n, s in zip(shape, strides):
        if n != 1:
            if s != expect:
                f = False
                break
            expect *= n
    return "F" if f else "A"


def c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Byte strides of a C-contiguous array of this shape (what numba uses for an array the CUDA
    array interface describes without strides, as torch describes a contiguous tensor)."""
    out = [0] * len(shape)
    s = itemsize
    for i in range(len(shape) - 1, -1, -1):
        out[i] = s
        s *= shape[i]
    return out


def tensor_params(t: Any) -> list[int]:
    """numba's kernel parameters of one array argument, from a torch CUDA tensor."""
    shape = tuple(t.shape)
    item = t.element_size()
    if t.is_contiguous():
        strides = c_strides(shape, item)
    else:
        strides = [s * item for s in t.stride()]
    return [0, 0, t.numel(), item, t.data_ptr(), *shape, *strides]


def _tensor_key(t: Any) -> tuple:
    if t.is_contiguous():
        return (t.dtype, t.dim(), "C")
    item = t.element_size()
    return (
        t.dtype,
        t.dim(),
        numba_layout(tuple(t.shape), tuple(s * item for s in t.stride()), item),
    )


def _plan_key(kernel: Any, args: tuple) -> tuple:
    """(kernel, current device, each argument's signature): what a plan is looked up by."""
    import torch

    return (kernel, torch.cuda.current_device()) + tuple(
        _tensor_key(a) if isinstance(a, torch.Tensor) else type(a) for a in args
    )


@dataclass
class _Plan:
    """One kernel and argument signature: the function handle and the parameter packing."""

    func: int
    fmt: struct.Struct
    tensors: tuple[bool, ...]  # per argument: a tensor (expands to several parameters)
    buf: Any = None  # ctypes buffer the parameters are packed into
    ptrs: Any = None  # void*[] pointing at each 8-byte slot of buf
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        n = self.fmt.size // 8
        self.buf = ctypes.create_string_buffer(max(8, self.fmt.size))
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(1, n))(*[base + 8 * i for i in range(n)])


@dataclass
class FastLauncher:
    """Plans by (kernel, device, signature); see the module docstring. A cache: dropping it only
    costs one numba launch per signature."""

    plans: dict[tuple, _Plan | None] = field(default_factory=dict)
    bypassed: int = 0
    _driver: Any = None

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple,
        stream: Any,
    ) -> bool:
        """Launch from a plan; False when there is none yet (the caller launches through
        numba and then calls `learn`). grid and block: (x, y, z), as numba_common.launch has
        checked them (launch_geometry.check)."""
        if self.bypassed:
            return False
        plan = self.plans.get(_plan_key(kernel, args))
        if plan is None:
            return False
        values: list[Any] = []
        for a, is_t in zip(args, plan.tensors):
            if is_t:
                values.extend(tensor_params(a))
            else:
                values.append(a)
        gx, gy, gz = grid
        bx, by, bz = block
        with plan.lock:
            plan.fmt.pack_into(plan.buf, 0, *values)
            (err,) = self._driver.cuLaunchKernel(
                plan.func, gx, gy, gz, bx, by, bz, 0, _stream_handle(stream),
                ctypes.addressof(plan.ptrs), 0,
            )  # fmt: skip
        if int(err):
            raise RuntimeError(f"cuLaunchKernel failed for {kernel}: {err!r}")
        return True

    def learn(self, kernel: Any, args: tuple, numba_args: tuple) -> None:
        """After a numba launch of `kernel` with `numba_args` (tensors converted), make the plan
        for this signature, or remember that it gets none."""
        key = _plan_key(kernel, args)
        if self.bypassed or key in self.plans:
            return
        self.plans[key] = self._make_plan(kernel, args, numba_args)

    def _make_plan(self, kernel: Any, args: tuple, numba_args: tuple) -> _Plan | None:
        import torch
        from numba.cuda import types

        if self._driver is None:
            from cuda.bindings import driver

            self._driver = driver
        if getattr(kernel, "_launch_config_sensitive", False) or kernel.specialized:
            return None
        argtypes = tuple(kernel.typeof_pyval(a) for a in numba_args)
        compiled = kernel.overloads.get(argtypes)
        if compiled is None or any(
            getattr(compiled, attr, False)
            for attr in ("launch_config_sensitive", "cooperative", "debug", "extensions")
        ):
            return None
        codes: list[str] = []
        tensors: list[bool] = []
        for a, ty in zip(args, compiled.argument_types):
            if isinstance(ty, types.Array):
                if not isinstance(a, torch.Tensor) or ty.layout != _tensor_key(a)[2]:
                    return None
                codes.append("q" * (5 + 2 * ty.ndim))
                tensors.append(True)
            else:
                code = _SCALAR_CODES.get(str(ty))
                if code is None or isinstance(a, torch.Tensor):
                    return None
                codes.append(code)
                tensors.append(False)
        return _Plan(
            _function_handle(self._driver, compiled),
            struct.Struct("<" + "".join(codes)),
            tuple(tensors),
        )

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """Every launch inside goes through numba (start-up tracing patches numba's call)."""
        self.bypassed += 1
        try:
            yield
        finally:
            self.bypassed -= 1


def _stream_handle(stream: Any) -> int:
    """The CUstream of a numba stream (torch's, through numba_common.current_stream)."""
    if stream is None:
        return 0
    h = stream.handle
    if isinstance(h, ctypes.c_void_p):
        return h.value or 0
    return int(h)


def _function_handle(driver: Any, compiled: Any) -> int:
    """The CUfunction of a compiled numba kernel in the current context. numba-cuda loads
    kernels as library kernels (CUkernel); cuLaunchKernel takes the context's CUfunction."""
    handle = compiled._codelibrary.get_cufunc().handle
    try:
        err, func = driver.cuKernelGetFunction(handle)
    except TypeError:  # already a CUfunction (a module-loaded kernel)
        return int(handle)
    if int(err):
        raise RuntimeError(f"cuKernelGetFunction failed for {compiled}: {err!r}")
    return int(func)


LAUNCHER = FastLauncher()
