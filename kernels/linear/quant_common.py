"""Device helpers shared by the group-quantized kernels (quant_gemv.py, quant_dequant.py,
quant_gemm_tc.py): the 16-byte load of packed code words and the code -> fp32 conversion.

Code -> float without an integer-to-float conversion instruction (I2F runs at a quarter of the
FP32 rate on Volta, and a 4-bit weight stream needs ~15 conversions per clock per SM): a code c
placed in the top mantissa bits of 1.0f reads as f = 1 + c / 2**bits exactly, so

    w = c * s + o = f * (2**bits * s) + (o - 2**bits * s)

one shift and one AND-OR (LOP3) per code, then one FMA with the group's folded (S, O). The fold
costs at most two bits of fp32 precision (|f * S| <= 2 * |S|), far below the fp16 rounding of the
reference's dequantized weight. `fold(s, o, bits)` makes (S, O); `code_f(u, p, bits)` is f for the
code at bit p of word u.

Factored form (quant_gemv's default at 1-2 fp16 rows): a chunk's codes share one (s, o), so
sum_k x_k w_k = s * sum_k x_k c_k + o * sum_k x_k, and a code needs only to become a float
proportional to c. The masked word itself does that: with the code at bits q..q+bits-1 and all
other bits zero (q + bits <= 24), its fp32 reading is c * 2**(q - 149) exactly (exponent fields 0
and 1 share the ulp 2**-149, so the integer below 2**24 is read linearly, no implicit 1 and so no
cancellation). `code_d_expr` gives that float for a code in place: one AND for codes within bits
0..23, one shift for the top code, a shift and an AND for the code at bits 24..27. The products
would be subnormal, so the x element meeting the code at bit q is scaled by 2**(D_SCALE - q)
(exact: a power of two, |x'| < 2**125 for fp16 x) and each product is x * c * 2**(D_SCALE - 149);
`fold_dot` gives the chunk's scale s * 2**(149 - D_SCALE). The FFMAs must keep subnormal operands
(no flush to zero: the kernels are built without fastmath).

In the CUDA simulator both are plain Python on ints.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32
from voltserve.kernels.runtime.numba_common import SIM

# Bit of the fp32 mantissa where a code's lowest bit goes: codes fill the top `bits` bits.
MANT_POS = {4: 19, 8: 15}
ONE_BITS = 0x3F800000
# Factored form: an x element meeting a code at bit q (<= 20) is scaled by 2**(D_SCALE - q) and
# its product with the code is x * c * 2**(D_SCALE - 149). For fp16 x every product is then
# exact when 24 <= D_SCALE <= 111: x is a multiple of 2**-24 (products multiples of 2**-149, the
# smallest subnormal, with 15 significant bits) and |x| < 2**16 keeps x' below 2**128.
D_SCALE = 109

if SIM:

    def ld_w4(arr, idx):
        """arr[r, c:c+4] of an int32 array as four uint32 (Python ints)."""
        r, c = idx
        return tuple(int(arr[r, c + j]) & 0xFFFFFFFF for j in range(4))

    def st_h8(arr, i, vals):
        for e in range(8):
            arr[i + e] = vals[e]

    def bits_f32(t):
        return np.array([int(t) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def ld_w4(typingctx, arr, idx):
        """arr[r, c:c+4] (int32, 2-D, c a multiple of 4, 16-byte aligned rows) as four uint32,
        one 16-byte global load."""
        if not (
            isinstance(arr, types.Array)
            and arr.dtype == types.int32
            and arr.ndim == 2
            and isinstance(idx, types.BaseTuple)
            and len(idx) == 2
            and all(isinstance(t, types.Integer) for t in idx)
        ):
            return None
        return types.UniTuple(types.uint32, 4)(arr, idx), ld16_codegen

    def ld16_codegen(context, builder, signature, args):
        """arr[r, c:c+16 bytes] of a 2-D array (args: arr, (r, c)) as four uint32 words, one
        16-byte global load: the codegen of ld_w4 and half2.ldh8 (the caller checks the
        alignment)."""
        arr_ty, idx_ty = signature.args
        ary = context.make_array(arr_ty)(context, builder, value=args[0])
        inds = [
            context.cast(builder, builder.extract_value(args[1], k), idx_ty[k], types.intp)
            for k in range(2)
        ]
        ptr = cgutils.get_item_pointer(context, builder, arr_ty, ary, inds, wraparound=False)
        vty = ir.VectorType(ir.IntType(32), 4)
        vp = builder.addrspacecast(builder.bitcast(ptr, vty.as_pointer()), vty.as_pointer(1))
        raw = builder.load(vp, align=16)
        words = [builder.extract_element(raw, ir.Constant(ir.IntType(32), j)) for j in range(4)]
        return context.make_tuple(builder, signature.return_type, words)

    @intrinsic
    def st_h8(typingctx, arr, idx, vals):
        """arr[idx:idx+8] = vals (8 float32 rounded to fp16) as one 16-byte store through a
        generic pointer (shared memory tiles; idx a multiple of 8, base 16-byte aligned)."""
        if not (
            isinstance(arr, types.Array)
            and arr.dtype == types.float16
            and arr.ndim == 1
            and isinstance(idx, types.Integer)
            and isinstance(vals, types.BaseTuple)
            and len(vals) == 8
            and all(t == types.float32 for t in vals)
        ):
            return None
        sig = types.void(arr, idx, vals)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty, _ = signature.args
            ary = context.make_array(arr_ty)(context, builder, value=args[0])
            i64 = context.cast(builder, args[1], idx_ty, types.int64)
            ptr = builder.gep(ary.data, [i64])
            i32 = ir.IntType(32)
            hvec = ir.Constant(ir.VectorType(ir.HalfType(), 8), ir.Undefined)
            for j in range(8):
                h = builder.fptrunc(builder.extract_value(args[2], j), ir.HalfType())
                hvec = builder.insert_element(hvec, h, ir.Constant(i32, j))
            vp = builder.bitcast(ptr, ir.VectorType(i32, 4).as_pointer())
            builder.store(builder.bitcast(hvec, ir.VectorType(i32, 4)), vp, align=16)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def bits_f32(typingctx, t):
        """The low 32 bits of integer t read as a float32 (a bitcast, what libdevice's
        int_as_float does). An intrinsic rather than an inlined device function: a generated
        kernel calls it once per weight, and numba re-runs its liveness analysis over the whole
        caller for every call it inlines (minutes of front end for one kernel)."""
        if not isinstance(t, types.Integer):
            return None
        sig = types.float32(t)

        def codegen(context, builder, signature, args):
            (v,) = args
            i32 = ir.IntType(32)
            if v.type.width > 32:
                v = builder.trunc(v, i32)
            elif v.type.width < 32:
                v = builder.zext(v, i32) if not signature.args[0].signed else builder.sext(v, i32)
            return builder.bitcast(v, ir.FloatType())

        return sig, codegen


ZERO_W4 = (uint32(0), uint32(0), uint32(0), uint32(0))


def code_f_expr(u: str, p: int, bits: int) -> str:
    """Source of f = 1 + c / 2**bits for the code at bit p of word `u` (generated kernels)."""
    pos = MANT_POS[bits]
    mask = ((1 << bits) - 1) << pos
    if p <= pos:
        moved = f"({u} << {pos - p})" if p < pos else u
    else:
        moved = f"({u} >> {p - pos})"
    return f"bits_f32(({moved} & {mask:#x}) | {ONE_BITS:#x})"


if SIM:

    @cuda.jit(device=True)
    def fold(s, o, scale_mul):
        """(S, O) with c * s + o == f * S + O for f = 1 + c / scale_mul (scale_mul = 2**bits)."""
        S = float32(s) * float32(scale_mul)
        return S, float32(o) - S

else:

    @intrinsic
    def fold(typingctx, s, o, scale_mul):
        """(S, O) = (float32(s) * float32(scale_mul), float32(o) - S), emitted as numba lowers
        those statements (an intrinsic for the reason bits_f32 is one)."""
        if not all(isinstance(t, (types.Float, types.Integer)) for t in (s, o, scale_mul)):
            return None
        sig = types.UniTuple(types.float32, 2)(s, o, scale_mul)

        def codegen(context, builder, signature, args):
            f32 = [
                context.cast(builder, v, t, types.float32)
                for v, t in zip(args, signature.args, strict=True)
            ]
            S = builder.fmul(f32[0], f32[2])
            return context.make_tuple(builder, signature.return_type, (S, builder.fsub(f32[1], S)))

        return sig, codegen


def code_d_expr(u: str, p: int, bits: int) -> tuple[str, int]:
    """(source of the masked code at bit p of word `u` as a float, q): the float is
    c * 2**(q - 149) exactly (factored form, see the module doc)."""
    mask = (1 << bits) - 1
    if p + bits == 32:
        return f"bits_f32({u} >> {p})", 0  # the top code: the shift clears the rest
    if p + bits <= 24:
        return f"bits_f32({u} & {mask << p:#x})", p
    return f"bits_f32(({u} >> 8) & {mask << (p - 8):#x})", p - 8


def x_scale(q: int) -> float:
    """The power of two an x element meeting a code at bit q is scaled by (factored form)."""
    return 2.0 ** (D_SCALE - q)


if SIM:

    @cuda.jit(device=True)
    def fold_dot(s, o, scale_mul):
        """(s * scale_mul, o) as float32: the factored chunk's scale and offset."""
        return float32(s) * float32(scale_mul), float32(o)

else:

    @intrinsic
    def fold_dot(typingctx, s, o, scale_mul):
        """(float32(s) * float32(scale_mul), float32(o)) (an intrinsic as fold is)."""
        if not all(isinstance(t, (types.Float, types.Integer)) for t in (s, o, scale_mul)):
            return None
        sig = types.UniTuple(types.float32, 2)(s, o, scale_mul)

        def codegen(context, builder, signature, args):
            f32 = [
                context.cast(builder, v, t, types.float32)
                for v, t in zip(args, signature.args, strict=True)
            ]
            return context.make_tuple(
                builder, signature.return_type, (builder.fmul(f32[0], f32[2]), f32[1])
            )

        return sig, codegen


def code_bit(e: int, bits: int) -> int:
    """Bit position of code e of a word in the pair-interleaved order (quant_pack.py)."""
    return 16 * (e & 1) + bits * (e >> 1)


__all__ = [
    "ld_w4",
    "st_h8",
    "bits_f32",
    "code_f_expr",
    "code_d_expr",
    "fold",
    "fold_dot",
    "x_scale",
    "code_bit",
    "ZERO_W4",
    "MANT_POS",
    "D_SCALE",
]
