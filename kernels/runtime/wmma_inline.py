"""Volta warp-matrix (wmma m16n16k16, f16 in, f32 accumulate) as numba intrinsics: the PTX
instructions wmma_ptx.cu wraps, emitted inline into the numba kernel instead of called through
a linked C function. Fragments are numba tuples held in registers, so a kernel can keep its
accumulators across a whole K loop that numba code drives (the dequantising GEMM,
quant_gemm_tc.py): no per-thread array the C ABI needs a pointer to, no call whose live values
cost the caller registers.

    frag_a = load_a(a_s, off, ld)        16 x 16 f16 tile, row-major, at a_s[off]
    frag_b = load_b_col(b_s, off, ld)    B = the 16 x 16 tile at b_s[off] (row-major [n][k]),
                                         read column-major, i.e. its transpose
    c = mma(c, frag_a, frag_b)           c += A * B (c: 8 f32 per lane, ZERO_C to start)
    store_c(st_s, off, c, ld)            the 16 x 16 f32 tile, row-major, at st_s[off]

a_s / b_s: 1-D float16 arrays, st_s: a 1-D float32 array, all in shared memory (the .shared
forms with 32-bit addresses: fewer address registers than generic ones); off and ld in elements; a tile start must be 32-byte aligned, ld a multiple of
8 (f16) or 4 (f32). Every call is warp-collective (.sync.aligned): all 32 lanes, same arguments.
Fragment layouts are opaque (the sm_70 ones): the kernel only moves them between these calls.

Under NUMBA_ENABLE_CUDASIM these are Python stand-ins with one made-up layout: an A or B
fragment is every lane's copy of the whole 16 x 16 tile (as fp32), and lane l's accumulator
holds row l >> 1, columns (l & 1) * 8 .. + 8 of C (device functions, so that the simulator gives
them its thread indices). The simulator tests then check everything
the kernel does around the products; the real instructions are checked by check-kernels (ptxas
assembles them for sm_70) and by the GPU tests.
"""

from __future__ import annotations

from numba import float32
from voltserve.kernels.runtime.numba_common import SIM

ZERO_C = (float32(0.0),) * 8

if SIM:
    import numpy as np
    from numba import cuda

    def _tile(arr, off, ld):
        return np.stack([np.asarray(arr[off + r * ld : off + r * ld + 16]) for r in range(16)])

    @cuda.jit(device=True)
    def load_a(arr, off, ld):
        return _tile(arr, off, ld).astype(np.float32)

    @cuda.jit(device=True)
    def load_b_col(arr, off, ld):
        return _tile(arr, off, ld).astype(np.float32)  # [n][k]

    @cuda.jit(device=True)
    def mma(c, a, b):
        lane = cuda.threadIdx.x & 31
        r, c0 = lane >> 1, (lane & 1) * 8
        return tuple(np.float32(c[e] + np.float32(np.dot(a[r], b[c0 + e]))) for e in range(8))

    @cuda.jit(device=True)
    def store_c(arr, off, c, ld):
        lane = cuda.threadIdx.x & 31
        r, c0 = lane >> 1, (lane & 1) * 8
        for e in range(8):
            arr[off + r * ld + c0 + e] = c[e]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()
    _REGS8 = "{" + ",".join(f"${i}" for i in range(8)) + "}"

    def _is_arr(t, dtype) -> bool:
        return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype

    def _address(context, builder, arr_ty, arr, off_ty, off):
        """The shared-window address of arr[off] (arr a shared array), a 32-bit integer."""
        ary = context.make_array(arr_ty)(context, builder, value=arr)
        i64 = context.cast(builder, off, off_ty, types.int64)
        ptr = builder.gep(ary.data, [i64])
        shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
        return builder.ptrtoint(shared, _I32)

    def _tuple_of(context, builder, ret_ty, struct, n):
        vals = [builder.extract_value(struct, i) for i in range(n)]
        return context.make_tuple(builder, ret_ty, vals)

    def _load_frag(op: str, layout: str):
        asm = f"wmma.load.{op}.sync.aligned.{layout}.m16n16k16.shared.f16 {_REGS8}, [$8], $9;"
        constraint = ",".join(["=r"] * 8 + ["r", "r", "~{memory}"])
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 8), [_I32, _I32])

        def typer(typingctx, arr, off, ld):
            if not (
                _is_arr(arr, types.float16)
                and isinstance(off, types.Integer)
                and isinstance(ld, types.Integer)
            ):
                return None
            sig = types.UniTuple(types.uint32, 8)(arr, off, ld)

            def codegen(context, builder, signature, args):
                arr_ty, off_ty, ld_ty = signature.args
                addr = _address(context, builder, arr_ty, args[0], off_ty, args[1])
                ld32 = context.cast(builder, args[2], ld_ty, types.int32)
                res = builder.asm(fnty, asm, constraint, [addr, ld32], side_effect=True)
                return _tuple_of(context, builder, signature.return_type, res, 8)

            return sig, codegen

        return intrinsic(typer)

    load_a = _load_frag("a", "row")
    load_b_col = _load_frag("b", "col")

    _MMA_ASM = (
        "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 "
        + _REGS8
        + ", {"
        + ",".join(f"${i}" for i in range(8, 16))
        + "}, {"
        + ",".join(f"${i}" for i in range(16, 24))
        + "}, {"
        + ",".join(f"${i}" for i in range(24, 32))
        + "};"
    )
    _MMA_CONSTRAINT = ",".join(["=f"] * 8 + ["r"] * 16 + ["f"] * 8)
    _MMA_FNTY = ir.FunctionType(ir.LiteralStructType([_F32] * 8), [_I32] * 16 + [_F32] * 8)

    @intrinsic
    def mma(typingctx, c, a, b):
        f32x8 = types.UniTuple(types.float32, 8)
        u32x8 = types.UniTuple(types.uint32, 8)
        if not (c == f32x8 and a == u32x8 and b == u32x8):
            return None
        sig = f32x8(c, a, b)

        def codegen(context, builder, signature, args):
            ops = [builder.extract_value(args[1], i) for i in range(8)]
            ops += [builder.extract_value(args[2], i) for i in range(8)]
            ops += [builder.extract_value(args[0], i) for i in range(8)]
            res = builder.asm(_MMA_FNTY, _MMA_ASM, _MMA_CONSTRAINT, ops, side_effect=True)
            return _tuple_of(context, builder, signature.return_type, res, 8)

        return sig, codegen

    _STORE_ASM = (
        "wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [$0], {"
        + ",".join(f"${i}" for i in range(1, 9))
        + "}, $9;"
    )
    _STORE_CONSTRAINT = ",".join(["r"] + ["f"] * 8 + ["r", "~{memory}"])
    _STORE_FNTY = ir.FunctionType(ir.VoidType(), [_I32] + [_F32] * 8 + [_I32])

    @intrinsic
    def store_c(typingctx, arr, off, c, ld):
        if not (
            _is_arr(arr, types.float32)
            and isinstance(off, types.Integer)
            and c == types.UniTuple(types.float32, 8)
            and isinstance(ld, types.Integer)
        ):
            return None
        sig = types.void(arr, off, c, ld)

        def codegen(context, builder, signature, args):
            arr_ty, off_ty, _, ld_ty = signature.args
            addr = _address(context, builder, arr_ty, args[0], off_ty, args[1])
            vals = [builder.extract_value(args[2], i) for i in range(8)]
            ld32 = context.cast(builder, args[3], ld_ty, types.int32)
            builder.asm(
                _STORE_FNTY, _STORE_ASM, _STORE_CONSTRAINT, [addr, *vals, ld32], side_effect=True
            )
            return context.get_dummy_value()

        return sig, codegen


__all__ = ["ZERO_C", "load_a", "load_b_col", "mma", "store_c"]
