"""16-byte vector loads and stores for the elementwise numba.cuda kernels.

numba indexes arrays one element at a time and cannot prove alignment, so a kernel written with
`x[row, i]` issues 2-byte loads for fp16; a memory-bound kernel reaches HBM bandwidth only with
16-byte accesses. These helpers move 8 consecutive elements of the last axis at once:

- `ld8(arr, idx)`: arr[idx[:-1]][idx[-1] : idx[-1] + 8] as a UniTuple of 8 float32 (idx a tuple
  with one integer per axis). fp16: one 16-byte load; fp32: two.
- `st8(arr, idx, vals)`: stores 8 float32 values there, each rounded to arr's dtype (round to
  nearest even, as a scalar store into arr would).

The caller guarantees what numba cannot check: the element address is 16-byte aligned (the last
index a multiple of 8, the array's base 16-byte aligned and every other stride a multiple of 8
elements) and the 8 elements lie inside the array. `vec_ok` checks the tensor side on the host;
launchers pass its answer to the kernel, which falls back to guarded scalar accesses
(`ld8_guard_2d` / `st8_guard_2d` here, or the kernel's own loop) when it is false.

And one element at a time, where a kernel indexes a large array many times per thread:

- `ld1(arr, idx)` / `st1(arr, idx, val)`: arr[idx] without numba's negative-index wraparound
  (a compare and a select per index, per access) or a bounds check: the address is the
  strides' dot product alone, which the compiler folds across a thread's unrolled accesses.
  The caller guarantees every index is in range.

The pointers are cast to the global address space (kernel arguments are device allocations), so
PTX has `ld.global.v4.u32` / `st.global.v4.u32` rather than generic accesses.

In the CUDA simulator both are plain Python on the array slices.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32
from numba.cuda.core import config

SIM: bool = bool(config.ENABLE_CUDASIM)
VEC = 8  # elements per vector access

if SIM:

    def ld8(arr, idx):
        row = arr[idx[:-1]] if len(idx) > 1 else arr
        c = idx[-1]
        return tuple(np.float32(row[c + e]) for e in range(VEC))

    def st8(arr, idx, vals):
        row = arr[idx[:-1]] if len(idx) > 1 else arr
        c = idx[-1]
        for e in range(VEC):
            row[c + e] = vals[e]

    def ld1(arr, idx):
        return arr[idx]

    def st1(arr, idx, val):
        arr[idx] = val

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _GLOBAL = 1  # NVPTX address space of global memory

    def _check(arr, idx) -> bool:
        return (
            isinstance(arr, types.Array)
            and arr.dtype in (types.float16, types.float32)
            and isinstance(idx, types.BaseTuple)
            and len(idx) == arr.ndim
            and all(isinstance(t, types.Integer) for t in idx)
        )

    def _pointer(context, builder, arr_ty, arr, idx_ty, idx):
        ary = context.make_array(arr_ty)(context, builder, value=arr)
        inds = [
            context.cast(builder, builder.extract_value(idx, k), idx_ty[k], types.intp)
            for k in range(arr_ty.ndim)
        ]
        return cgutils.get_item_pointer(context, builder, arr_ty, ary, inds, wraparound=False)

    def _vec_ptrs(builder, ptr, is_half: bool) -> list[Any]:
        """Global-space pointers to the one (fp16) or two (fp32) 16-byte pieces."""
        if is_half:
            vty = ir.VectorType(ir.IntType(32), 4)
            return [
                builder.addrspacecast(
                    builder.bitcast(ptr, vty.as_pointer()), vty.as_pointer(_GLOBAL)
                )
            ]
        vty = ir.VectorType(ir.FloatType(), 4)
        out = []
        for k in range(2):
            p = builder.gep(ptr, [ir.Constant(ir.IntType(64), 4 * k)])
            out.append(
                builder.addrspacecast(builder.bitcast(p, vty.as_pointer()), vty.as_pointer(_GLOBAL))
            )
        return out

    @intrinsic
    def ld8(typingctx, arr, idx):
        if not _check(arr, idx):
            return None
        sig = types.UniTuple(types.float32, VEC)(arr, idx)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty = signature.args
            ptr = _pointer(context, builder, arr_ty, args[0], idx_ty, args[1])
            is_half = arr_ty.dtype == types.float16
            vals = []
            for vp in _vec_ptrs(builder, ptr, is_half):
                raw = builder.load(vp, align=16)
                if is_half:
                    halves = builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8))
                    for j in range(8):
                        h = builder.extract_element(halves, ir.Constant(ir.IntType(32), j))
                        vals.append(builder.fpext(h, ir.FloatType()))
                else:
                    for j in range(4):
                        vals.append(builder.extract_element(raw, ir.Constant(ir.IntType(32), j)))
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def st8(typingctx, arr, idx, vals):
        if not _check(arr, idx):
            return None
        if not (
            isinstance(vals, types.BaseTuple)
            and len(vals) == VEC
            and all(t == types.float32 for t in vals)
        ):
            return None
        sig = types.void(arr, idx, vals)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty, _ = signature.args
            ptr = _pointer(context, builder, arr_ty, args[0], idx_ty, args[1])
            is_half = arr_ty.dtype == types.float16
            xs = [builder.extract_value(args[2], j) for j in range(VEC)]
            i32 = ir.IntType(32)
            if is_half:
                hvec = ir.Constant(ir.VectorType(ir.HalfType(), 8), ir.Undefined)
                for j, x in enumerate(xs):
                    h = builder.fptrunc(x, ir.HalfType())
                    hvec = builder.insert_element(hvec, h, ir.Constant(i32, j))
                (vp,) = _vec_ptrs(builder, ptr, True)
                builder.store(builder.bitcast(hvec, ir.VectorType(i32, 4)), vp, align=16)
            else:
                for k, vp in enumerate(_vec_ptrs(builder, ptr, False)):
                    fvec = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
                    for j in range(4):
                        fvec = builder.insert_element(fvec, xs[4 * k + j], ir.Constant(i32, j))
                    builder.store(fvec, vp, align=16)
            return context.get_dummy_value()

        return sig, codegen

    def _check1(arr, idx) -> bool:
        return (
            isinstance(arr, types.Array)
            and isinstance(idx, types.BaseTuple)
            and len(idx) == arr.ndim
            and all(isinstance(t, types.Integer) for t in idx)
        )

    def _global(builder, ptr):
        return builder.addrspacecast(ptr, ptr.type.pointee.as_pointer(_GLOBAL))

    @intrinsic
    def ld1(typingctx, arr, idx):
        if not _check1(arr, idx):
            return None
        sig = arr.dtype(arr, idx)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty = signature.args
            ptr = _pointer(context, builder, arr_ty, args[0], idx_ty, args[1])
            return builder.load(_global(builder, ptr))

        return sig, codegen

    @intrinsic
    def st1(typingctx, arr, idx, val):
        if not _check1(arr, idx) or val != arr.dtype:
            return None
        sig = types.void(arr, idx, val)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty, _ = signature.args
            ptr = _pointer(context, builder, arr_ty, args[0], idx_ty, args[1])
            builder.store(args[2], _global(builder, ptr))
            return context.get_dummy_value()

        return sig, codegen


ZERO8 = (float32(0.0),) * VEC  # an 8-element chunk of zeros (guarded loads past the end)


if SIM:

    def dot8(acc, a, b):
        """acc + a . b for two 8-element chunks (fp32)."""
        return (
            acc
            + a[0] * b[0]
            + a[1] * b[1]
            + a[2] * b[2]
            + a[3] * b[3]
            + a[4] * b[4]
            + a[5] * b[5]
            + a[6] * b[6]
            + a[7] * b[7]
        )

else:

    @intrinsic
    def dot8(typingctx, acc, a, b):
        """acc + a . b for two 8-element chunks (fp32): ((acc + a0 b0) + a1 b1) + ..., the
        multiplies and adds numba emits for that expression (NVVM contracts each pair to an
        FMA). An intrinsic, not an inlined device function: numba re-runs its liveness analysis
        over the whole caller for every call it inlines, and a generated GEMV step makes dozens
        of these calls (the PTX is the same either way, scripts/ptx_diff.py)."""
        vec = types.UniTuple(types.float32, VEC)
        if acc != types.float32 or a != vec or b != vec:
            return None

        def codegen(context, builder, signature, args):
            x, av, bv = args
            for j in range(VEC):
                prod = builder.fmul(builder.extract_value(av, j), builder.extract_value(bv, j))
                x = builder.fadd(x, prod)
            return x

        return types.float32(acc, a, b), codegen


# Guarded scalar versions for rows that are not vectorisable (width not a multiple of 8, or an
# unaligned view): the same 8-element chunk, element by element, zero past the end of the row.


@cuda.jit(device=True, inline="always")
def _g2(arr, r, c, n):
    v = float32(0.0)
    if c < n:
        v = float32(arr[r, c])
    return v


@cuda.jit(device=True, inline="always")
def _g1(arr, c, n):
    v = float32(0.0)
    if c < n:
        v = float32(arr[c])
    return v


@cuda.jit(device=True, inline="always")
def ld8_guard_2d(arr, r, c, n):
    return (
        _g2(arr, r, c, n),
        _g2(arr, r, c + 1, n),
        _g2(arr, r, c + 2, n),
        _g2(arr, r, c + 3, n),
        _g2(arr, r, c + 4, n),
        _g2(arr, r, c + 5, n),
        _g2(arr, r, c + 6, n),
        _g2(arr, r, c + 7, n),
    )


@cuda.jit(device=True, inline="always")
def ld8_guard_1d(arr, c, n):
    return (
        _g1(arr, c, n),
        _g1(arr, c + 1, n),
        _g1(arr, c + 2, n),
        _g1(arr, c + 3, n),
        _g1(arr, c + 4, n),
        _g1(arr, c + 5, n),
        _g1(arr, c + 6, n),
        _g1(arr, c + 7, n),
    )


@cuda.jit(device=True, inline="always")
def st8_guard_2d(arr, r, c, n, vals):
    for e in range(VEC):
        if c + e < n:
            arr[r, c + e] = vals[e]


@cuda.jit(device=True, inline="always")
def load_row8(arr, r, c, n, vec):
    """arr[r, c:c+8] (zero past n) as 8 float32: one vector access when vec, else guarded."""
    if vec:
        return ld8(arr, (r, c))
    return ld8_guard_2d(arr, r, c, n)


@cuda.jit(device=True, inline="always")
def load_vec8(arr, c, n, vec):
    """arr[c:c+8] of a 1-D array (zero past n) as 8 float32."""
    if vec:
        return ld8(arr, (c,))
    return ld8_guard_1d(arr, c, n)


@cuda.jit(device=True, inline="always")
def store_row8(arr, r, c, n, vec, vals):
    """arr[r, c:c+8] = vals (only below n on the guarded path), rounded to arr's dtype."""
    if vec:
        st8(arr, (r, c), vals)
    else:
        st8_guard_2d(arr, r, c, n, vals)


@cuda.jit(device=True, inline="always")
def tup8(buf, o):
    """buf[o:o+8] of a local array as a tuple (the form st8 takes)."""
    return (
        buf[o],
        buf[o + 1],
        buf[o + 2],
        buf[o + 3],
        buf[o + 4],
        buf[o + 5],
        buf[o + 6],
        buf[o + 7],
    )


# ---------------------------------------------------------------------------------------------
# Host side


def vec_ok(*tensors: Any) -> bool:
    """True when every tensor's last axis can be read 8 elements at a time with 16-byte accesses:
    unit stride along it, its length, every other stride and the base address multiples of 8
    elements / 16 bytes. (fp32 takes two 16-byte accesses per 8 elements.)"""
    for t in tensors:
        if t.dim() == 0 or t.shape[-1] % VEC or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(s % VEC for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1):
            return False  # the stride of a length-1 axis is never used
    return True


__all__ = [
    "VEC",
    "ld1",
    "ld8",
    "st1",
    "st8",
    "load_row8",
    "load_vec8",
    "store_row8",
    "tup8",
    "vec_ok",
]
