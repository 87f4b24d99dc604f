"""Pieces shared by the numba.cuda attention kernels (attention/decode.py, attention/prefill.py).

- `ld_f16x8(arr, i)`: one 16-byte load of fp16 elements arr[i:i+8] (i a multiple of 8, arr a
  flat fp16 array whose base is 16-byte aligned), widened to eight fp32 values. numba indexes
  arrays one element at a time and cannot prove alignment, so without this each thread would
  issue eight 2-byte loads; the KV cache streams at full bandwidth only with 16-byte loads.
- `ld_u32x4(arr, i)`: the same 16-byte load, kept raw as four uint32 (two fp16 each; of a flat
  uint8 array, four one-byte codes each: arr[i:i+16]), and `half_lo(u)` / `half_hi(u)`: one fp16
  of such a word widened to fp32. Splitting the load from
  the widening keeps a batch of in-flight loads at 4 registers each instead of 8, and puts each
  conversion next to its use.
- `st_u32x4(arr, i, w0, w1, w2, w3)`: the matching 16-byte store of four such words into
  arr[i:i+8] (a register-staged copy: load now, store after other work).
- `shfl_xor(value, lane_mask)`: warp butterfly exchange of a float32 (full mask).

The CUDA simulator (NUMBA_ENABLE_CUDASIM=1, the CPU test path) has neither LLVM intrinsics nor
warp shuffles, so under it both helpers are plain Python: the load slices the array, and the
shuffle exchanges through the block's shared state with two barriers. That shuffle is exact only
when a block is ONE warp and every lane calls it the same number of times, which is how the
simulator tests launch the kernels (32 threads per block).
"""

from __future__ import annotations

import threading

import numpy as np
from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF

if SIMULATOR:

    def ld_f16x8(arr, i):
        return tuple(np.float32(x) for x in arr[i : i + 8])

    def ld_u32x4(arr, i):
        n = 16 // arr.dtype.itemsize
        raw = np.array([arr[i + j] for j in range(n)], dtype=arr.dtype).view(np.uint32)
        return tuple(raw)

    def st_u32x4(arr, i, w0, w1, w2, w3):
        raw = np.array([w0, w1, w2, w3], dtype=np.uint32).view(np.float16)
        for j in range(8):
            arr[i + j] = raw[j]

    def half_lo(u):
        return np.float32(np.array([int(u) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    def half_hi(u):
        return np.float32(np.array([int(u) >> 16], dtype=np.uint16).view(np.float16)[0])

    def shfl_xor(value, lane_mask):
        thread = threading.current_thread()
        manager = thread._manager  # the simulator's BlockManager of this block
        slots = manager.__dict__.setdefault("_voltserve_shfl", {})
        tid = thread.thread_id
        slots[tid] = value
        thread.syncthreads()
        other = slots[tid ^ lane_mask]
        thread.syncthreads()
        return other

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def ld_f16x8(typingctx, arr, idx):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float16 and arr.ndim == 1):
            return None
        if not isinstance(idx, types.Integer):
            return None
        sig = types.UniTuple(types.float32, 8)(arr, idx)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty = signature.args
            ary = context.make_array(arr_ty)(context, builder, value=args[0])
            i64 = context.cast(builder, args[1], idx_ty, types.int64)
            ptr = builder.gep(ary.data, [i64])
            vec_ptr = builder.bitcast(ptr, ir.VectorType(ir.IntType(32), 4).as_pointer())
            raw = builder.load(vec_ptr, align=16)
            halves = builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8))
            vals = [
                builder.fpext(
                    builder.extract_element(halves, ir.Constant(ir.IntType(32), j)),
                    ir.FloatType(),
                )
                for j in range(8)
            ]
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def ld_u32x4(typingctx, arr, idx):
        if not (
            isinstance(arr, types.Array)
            and arr.dtype in (types.float16, types.uint8)
            and arr.ndim == 1
        ):
            return None
        if not isinstance(idx, types.Integer):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, signature, args):
            arr_ty, idx_ty = signature.args
            ary = context.make_array(arr_ty)(context, builder, value=args[0])
            i64 = context.cast(builder, args[1], idx_ty, types.int64)
            ptr = builder.gep(ary.data, [i64])
            vec_ptr = builder.bitcast(ptr, ir.VectorType(ir.IntType(32), 4).as_pointer())
            raw = builder.load(vec_ptr, align=16)
            words = [builder.extract_element(raw, ir.Constant(ir.IntType(32), j)) for j in range(4)]
            return context.make_tuple(builder, signature.return_type, words)

        return sig, codegen

    @intrinsic
    def st_u32x4(typingctx, arr, idx, w0, w1, w2, w3):
        words = (w0, w1, w2, w3)
        if not (isinstance(arr, types.Array) and arr.dtype == types.float16 and arr.ndim == 1):
            return None
        if not isinstance(idx, types.Integer) or not all(
            isinstance(w, types.Integer) for w in words
        ):
            return None
        sig = types.void(arr, idx, *words)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            i64 = context.cast(builder, args[1], signature.args[1], types.int64)
            i32 = ir.IntType(32)
            vec = ir.Constant(ir.VectorType(i32, 4), None)
            for j, (w, ty) in enumerate(zip(args[2:], signature.args[2:], strict=True)):
                vec = builder.insert_element(
                    vec, context.cast(builder, w, ty, types.uint32), ir.Constant(i32, j)
                )
            ptr = builder.bitcast(builder.gep(ary.data, [i64]), ir.VectorType(i32, 4).as_pointer())
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen

    def _half_of(shift: int):
        def half(typingctx, word):
            if not isinstance(word, types.Integer):
                return None
            sig = types.float32(word)

            def codegen(context, builder, signature, args):
                w = args[0]
                if w.type.width != 32:
                    w = builder.trunc(w, ir.IntType(32)) if w.type.width > 32 else w
                if shift:
                    w = builder.lshr(w, ir.Constant(ir.IntType(32), shift))
                h = builder.bitcast(builder.trunc(w, ir.IntType(16)), ir.HalfType())
                return builder.fpext(h, ir.FloatType())

            return sig, codegen

        half.__name__ = "half_hi" if shift else "half_lo"
        return half

    half_lo = intrinsic(_half_of(0))
    half_hi = intrinsic(_half_of(16))

    def shfl_bfly_ir(builder, value, lane_mask: int):
        """IR of cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) for an i32 or float value, as
        numba lowers it: one llvm.nvvm.shfl.sync.i32 in butterfly mode (3), clamp 0x1F."""
        i32 = ir.IntType(32)
        is_float = isinstance(value.type, ir.FloatType)
        a = builder.bitcast(value, i32) if is_float else value
        fnty = ir.FunctionType(ir.LiteralStructType((i32, ir.IntType(1))), (i32,) * 5)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.nvvm.shfl.sync.i32")
        b = lane_mask if isinstance(lane_mask, ir.Value) else ir.Constant(i32, lane_mask)
        mask, mode, clamp = (ir.Constant(i32, c) for c in (FULL_MASK, 3, 0x1F))
        d = builder.extract_value(builder.call(fn, (mask, mode, a, b, clamp)), 0)
        return builder.bitcast(d, ir.FloatType()) if is_float else d

    @intrinsic
    def shfl_xor(typingctx, value, lane_mask):
        """cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) for 32-bit floats and ints. An
        intrinsic rather than an inlined device function: the generated decode kernels shuffle
        ~200 times, and numba re-runs its liveness analysis over the whole caller for every
        call it inlines (kernels/CONTRIBUTING: compile time)."""
        if value not in (types.float32, types.int32, types.uint32):
            return None
        if not isinstance(lane_mask, types.Integer):
            return None
        sig = value(value, lane_mask)

        def codegen(context, builder, signature, args):
            a, b = args
            b = builder.trunc(b, ir.IntType(32)) if b.type.width > 32 else b
            return shfl_bfly_ir(builder, a, b)

        return sig, codegen


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def check_paged_cache(q, k_cache, v_cache, block_size: int, cache_dtype=None, **int32_args) -> None:
    """The launchers' shared checks of a paged KV cache [blocks, kv_heads, block_size, D] against
    q [..., H, D]: shapes, fp16 q and cache storage (cache_dtype: another storage, e.g. uint8
    for the one-byte caches), contiguous and 16-byte aligned caches (the kernels read them in
    16-byte vectors), and int32 for every named tensor in int32_args (block tables, sequence
    lengths, query offsets)."""
    import torch

    cache_dtype = cache_dtype or torch.float16

    D = q.shape[-1]
    if k_cache.shape[2:] != (block_size, D) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
            f"[blocks, kv_heads, {block_size}, {D}]"
        )
    if q.dtype != torch.float16 or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise TypeError(
            f"fp16 only (q; cache {cache_dtype}), got q {q.dtype}, cache "
            f"{k_cache.dtype}/{v_cache.dtype}"
        )
    for name, t in int32_args.items():
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        raise ValueError("KV caches must be 16-byte aligned (16-byte vector loads)")
