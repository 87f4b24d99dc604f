"""Packed fp16 pairs (half2) for the numba.cuda kernels: the f16x2 PTX instructions emitted
inline (ir.InlineAsm, as wmma_inline.py does), on uint32 values that carry the two halves' bits
(low half = bits 0..15, the element at the lower address of a 16-byte load).

    h2fma(a, b, c)     fma.rn.f16x2: a * b + c per half, one rounding
    h2mul(a, b)        mul.rn.f16x2: a * b per half
    h2f(u)             (float32(low half), float32(high half)): cvt.f32.f16 of each
    prmt(a, sel)       prmt.b32 of a with itself: byte i of the result is byte (sel >> 4i) & 3
                       of a (a constant selector: one instruction regrouping packed codes)
    prmt2(a, b, sel)   prmt.b32 of the pair: byte i of the result is byte (sel >> 4i) & 7 of
                       the 8 bytes b:a (0-3 from a, 4-7 from b; a constant selector): halves
                       of two words into one, or bytes next to zeros (b = 0)
    ldh8(arr, (r, c))  arr[r, c:c+8] of a 2-D float16 array as four uint32 (the half2 pairs
                       (x0, x1), (x2, x3), (x4, x5), (x6, x7)), one 16-byte global load; c a
                       multiple of 8, rows 16-byte aligned

The `.rn` forms are never contracted or flushed: subnormal halves are kept (no `.ftz`, and the
kernels are built without fastmath). Integer arguments of any width are truncated to their low
32 bits, so a generated kernel can pass the masked words of quant_common (typed int64 by numba)
and half2 constants written as integer literals.

Under NUMBA_ENABLE_CUDASIM these are plain Python on ints: each half is read through numpy's
float16, the operation is done in float64 and rounded to float16 once (what the hardware's
single rounding gives for the operands the kernels pass: products of two halves are exact in
float64, and the sums the kernels form stay well inside float64's range of exact addition).
"""

from __future__ import annotations

import struct

import numpy as np
from voltserve.kernels.runtime.numba_common import SIM

# Every fp16 bit pattern's value (the simulator's unpacking: a list lookup).
_HALF = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64).tolist()


def _half_bits(v: float) -> int:
    """v rounded to fp16 (to nearest, ties to even; past the largest finite: inf), as bits."""
    try:
        return int.from_bytes(struct.pack("<e", v), "little")
    except OverflowError:
        return 0xFC00 if v < 0 else 0x7C00


def h2_bits(lo: float, hi: float) -> int:
    """The uint32 bits of the half2 (lo, hi) rounded to fp16 (host side: constants of generated
    kernels; the simulator's packing)."""
    return _half_bits(lo) | _half_bits(hi) << 16


def h2_vals(u: int) -> tuple[float, float]:
    """The two halves of uint32 bits u as Python floats (host side and simulator)."""
    u = int(u)
    return _HALF[u & 0xFFFF], _HALF[(u >> 16) & 0xFFFF]


if SIM:
    _pack = h2_bits

    def h2fma(a, b, c):
        a0, a1 = h2_vals(a)
        b0, b1 = h2_vals(b)
        c0, c1 = h2_vals(c)
        return _pack(a0 * b0 + c0, a1 * b1 + c1)

    def h2mul(a, b):
        a0, a1 = h2_vals(a)
        b0, b1 = h2_vals(b)
        return _pack(a0 * b0, a1 * b1)

    def h2f(u):
        lo, hi = h2_vals(u)
        return np.float32(lo), np.float32(hi)

    def prmt(a, sel):
        a = int(a) & 0xFFFFFFFF
        out = 0
        for i in range(4):
            out |= ((a >> (8 * ((int(sel) >> (4 * i)) & 3))) & 0xFF) << (8 * i)
        return out

    def prmt2(a, b, sel):
        ab = (int(a) & 0xFFFFFFFF) | (int(b) & 0xFFFFFFFF) << 32
        out = 0
        for i in range(4):
            out |= ((ab >> (8 * ((int(sel) >> (4 * i)) & 7))) & 0xFF) << (8 * i)
        return out

    def ldh8(arr, idx):
        r, c = idx
        row = np.ascontiguousarray(np.asarray(arr[r, c : c + 8]), dtype=np.float16)
        return tuple(int(v) for v in row.view(np.uint32))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
    from voltserve.kernels.linear.quant_common import ld16_codegen

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _u32(builder, v):
        """An integer LLVM value as i32 (its low 32 bits)."""
        if v.type.width > 32:
            return builder.trunc(v, _I32)
        if v.type.width < 32:
            return builder.zext(v, _I32)
        return v

    def _ints(*tys) -> bool:
        return all(isinstance(t, types.Integer) for t in tys)

    def _uint32_op(asm: str, n: int):
        """An intrinsic of n integer operands (each's low 32 bits) and one uint32 result."""
        fnty = ir.FunctionType(_I32, [_I32] * n)
        constraints = ",".join(["=r"] + ["r"] * n)

        def codegen(context, builder, signature, args):
            ops = [_u32(builder, v) for v in args]
            return builder.asm(fnty, asm, constraints, ops, side_effect=False)

        # numba reads a typer's arity from its signature: one per operand count
        if n == 2:

            def typer(typingctx, a, b):
                return (types.uint32(a, b), codegen) if _ints(a, b) else None

        else:

            def typer(typingctx, a, b, c):
                return (types.uint32(a, b, c), codegen) if _ints(a, b, c) else None

        return intrinsic(typer)

    h2mul = _uint32_op("mul.rn.f16x2 $0, $1, $2;", 2)
    h2fma = _uint32_op("fma.rn.f16x2 $0, $1, $2, $3;", 3)

    _H2F_ASM = "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
    _H2F_TY = ir.FunctionType(ir.LiteralStructType([_F32, _F32]), [_I32])

    @intrinsic
    def h2f(typingctx, u):
        if not _ints(u):
            return None
        sig = types.UniTuple(types.float32, 2)(u)

        def codegen(context, builder, signature, args):
            res = builder.asm(_H2F_TY, _H2F_ASM, "=f,=f,r", [_u32(builder, args[0])], False)
            vals = [builder.extract_value(res, i) for i in range(2)]
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def prmt(typingctx, a, sel):
        if not _ints(a) or not isinstance(sel, types.IntegerLiteral):
            return None
        selector = int(sel.literal_value) & 0x3333

        def codegen(context, builder, signature, args):
            asm = f"prmt.b32 $0, $1, $1, {selector:#x};"
            fnty = ir.FunctionType(_I32, [_I32])
            return builder.asm(fnty, asm, "=r,r", [_u32(builder, args[0])], side_effect=False)

        return types.uint32(a, sel), codegen

    _PRMT2_TY = ir.FunctionType(_I32, [_I32, _I32])

    @intrinsic
    def prmt2(typingctx, a, b, sel):
        # Selector nibbles 0-7 only: bit 3 of a nibble (sign-replicate mode) is masked off.
        if not _ints(a, b) or not isinstance(sel, types.IntegerLiteral):
            return None
        selector = int(sel.literal_value) & 0x7777

        def codegen(context, builder, signature, args):
            asm = f"prmt.b32 $0, $1, $2, {selector:#x};"
            ops = [_u32(builder, v) for v in args[:2]]
            return builder.asm(_PRMT2_TY, asm, "=r,r,r", ops, side_effect=False)

        return types.uint32(a, b, sel), codegen

    @intrinsic
    def ldh8(typingctx, arr, idx):
        if not (
            isinstance(arr, types.Array)
            and arr.dtype == types.float16
            and arr.ndim == 2
            and isinstance(idx, types.BaseTuple)
            and len(idx) == 2
            and _ints(*idx)
        ):
            return None
        return types.UniTuple(types.uint32, 4)(arr, idx), ld16_codegen


__all__ = ["h2fma", "h2mul", "h2f", "ldh8", "prmt", "prmt2", "h2_bits", "h2_vals"]
