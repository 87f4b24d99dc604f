"""Tensor-core paged prefill attention for Volta (SM70) and newer: numba.cuda orchestration around
the warp-matrix (wmma m16n16k16, f16 in, f32 accumulate) device functions of wmma_ptx.cu.

Meaning: `paged_attention_ref` in attention_ref.py (flat batch of query tokens from several
sequences, paged KV cache [num_blocks, num_kv_heads, 16, head_dim], causal with query i of a
sequence at position seq_len - q_len + i, head h reads KV head h // group). fp16 in and out.

Flash-attention layout. A thread block (4 warps) owns one sequence, one KV head and 64 rows,
a row being a (query token, query head of that KV head) pair, so a tile holds 64 // group tokens
and each K/V tile is read once for all the heads that share it. Each warp owns 16 rows. Per KV
tile of 32 keys (two cache blocks):
  1. all threads store K and V into shared memory from registers (16-byte words; zeros past the
     context), then load their chunks of the next tile into those registers,
  2. each warp computes S[16, 32] = Q K^T with wmma into fp32 shared memory,
  3. two lanes per row run the online softmax in fp32 (running max and sum in registers) and
     write P as fp16 (into the K buffer, free by then),
  4. each warp rescales its fp32 output accumulator by exp(m_old - m_new) per row and adds
     P V with wmma; the accumulator fragments live in a per-thread array.
At the end each warp scales rows by 1 / sum and writes fp16 rows through a small f32 staging
tile. The fill of step 1 is register-staged and double-buffered: each thread loads its chunks of
tile t+1 into registers (`fetch_kv`) right after storing tile t's (`store_kv`), so the
global-memory latency of the next tile (a block-table read, then the K/V reads) overlaps this
tile's scores, softmax and PV instead of opening every iteration before a barrier. At f0ff47c
on an H200 (8 x 1024 tokens, Llama-3-8B heads) it ran in 1.392 ms (49.4 TFLOP/s) against 1.520
ms (45.3 TFLOP/s) for the direct global-to-shared copy it replaced, faster in each of three
rounds. The kernel is latency-bound at serving shapes (2 blocks per SM; 255 registers a thread
at head_dim 128 on sm_70, 172 with the direct copy). Row-wise scaling of accumulator fragments,
whose layout is opaque, uses a "row map" tile (see wmma_ptx.cu).

Shared memory (head_dim 128): Q 17 KB + K/P 8.5 KB + V 8.5 KB + S 9 KB + 1.3 KB, under the
48 KB static limit. numba passes shared and local arrays to the C++ functions as pointers via
cffi's `ffi.from_buffer`.

The CUDA simulator cannot run linked C++: under NUMBA_ENABLE_CUDASIM this module imports but its
launcher raises.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from numba import cuda, float32, int32, int64, uint32
from numba.core.types import float16
from voltserve.kernels.attention_common import ld_u32x4, st_u32x4
from voltserve.kernels.compile_cache import cached, cached_factory
from voltserve.kernels.numba_common import SIM

WMMA_CU = str(Path(__file__).with_name("wmma_ptx.cu"))
# CUDA C++ files the kernels of this module link; `voltserve check-kernels` compiles them too.
CUDA_SOURCES: tuple[str, ...] = (WMMA_CU,)

BLOCK_SIZE = 16  # tokens per KV cache block
WARPS = 4
NUM_THREADS = 32 * WARPS
ROWS = 16 * WARPS  # (token, head) rows per thread block
KV_TILE = 32  # keys per tile: must equal VS_KV_TILE in wmma_ptx.cu
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634

if not SIM:
    import cffi
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    ffi = cffi.FFI()
    _P16 = types.CPointer(types.float16)
    _P32 = types.CPointer(types.float32)
    _I32 = types.int32

    def _declare(name: str, *args):
        return cuda.declare_device(name, types.int32(*args), link=[WMMA_CU], abi="c")

    # d[16,16] f32 = a[16,k] @ b (b row-major [k,16], or column-major when b_col != 0)
    wmma_gemm16 = _declare("vs_wmma_gemm16", _P32, _P16, _P16, _I32, _I32)
    # (s, s_off, lds, q, q_off, ldq, k, ldk)
    _SCORES_ARGS = (_P32, _I32, _I32, _P16, _I32, _I32, _P16, _I32)
    # (acc, p, p_off, ldp, v, ldv, rowmap, alpha, alpha_off)
    _PV_ARGS = (_P32, _P16, _I32, _I32, _P16, _I32, _P32, _P32, _I32)
    attn_scores = {d: _declare(f"vs_attn_scores_d{d}", *_SCORES_ARGS) for d in HEAD_DIMS}
    attn_pv = {d: _declare(f"vs_attn_pv_d{d}", *_PV_ARGS) for d in HEAD_DIMS}
    # (acc, j, stage, st_off, ld, rowmap, row_scale, scale_off)
    attn_store_tile = _declare("vs_attn_store_tile", _P32, _I32, _P32, _I32, _I32, _P32, _P32, _I32)

    @intrinsic
    def copy16(typingctx, dst, dst_idx, src, src_idx):
        """dst[dst_idx:dst_idx+8] = src[src_idx:src_idx+8] as one 16-byte load and store (fp16
        1-D arrays; both indices multiples of 8 and both bases 16-byte aligned)."""
        for arr in (dst, src):
            if not (isinstance(arr, types.Array) and arr.dtype == types.float16 and arr.ndim == 1):
                return None
        if not (isinstance(dst_idx, types.Integer) and isinstance(src_idx, types.Integer)):
            return None
        sig = types.void(dst, dst_idx, src, src_idx)

        def codegen(context, builder, signature, args):
            dst_ty, di_ty, src_ty, si_ty = signature.args
            vec = ir.VectorType(ir.IntType(32), 4).as_pointer()
            d = context.make_array(dst_ty)(context, builder, value=args[0])
            s = context.make_array(src_ty)(context, builder, value=args[2])
            di = context.cast(builder, args[1], di_ty, types.int64)
            si = context.cast(builder, args[3], si_ty, types.int64)
            src_ptr = builder.bitcast(builder.gep(s.data, [si]), vec)
            dst_ptr = builder.bitcast(builder.gep(d.data, [di]), vec)
            builder.store(builder.load(src_ptr, align=16), dst_ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen


# The K/V fill's halves (plain numba: the CUDA simulator runs them in the CPU tests).
@cuda.jit(device=True)
def fetch_kv(src, kv0, idx, CH, D):
    """Chunk idx of the K/V tile starting at position kv0 (token idx // CH, 16-byte column
    idx % CH) as 8 words, K's then V's; zeros past the context (never stale cache data:
    0 * NaN = NaN in an mma). src = (k_cache, v_cache, block_tables, b, kvh, num_kv_heads,
    seq_len)."""
    k_cache, v_cache, block_tables, b, kvh, num_kv_heads, seq_len = src
    t = idx // CH
    pos = kv0 + t
    if pos < seq_len:
        blk = int64(block_tables[b, pos // BLOCK_SIZE])
        off = ((blk * num_kv_heads + kvh) * BLOCK_SIZE + pos % BLOCK_SIZE) * D
        off += (idx - t * CH) * 8
        k0, k1, k2, k3 = ld_u32x4(k_cache, off)
        v0, v1, v2, v3 = ld_u32x4(v_cache, off)
        return k0, k1, k2, k3, v0, v1, v2, v3
    z = uint32(0)
    return z, z, z, z, z, z, z, z


@cuda.jit(device=True)
def store_kv(k_s, v_s, r, idx, CH, LDK):
    """fetch_kv's words for chunk idx into the shared K and V tiles (row stride LDK)."""
    t = idx // CH
    dst = t * LDK + (idx - t * CH) * 8
    st_u32x4(k_s, dst, r[0], r[1], r[2], r[3])
    st_u32x4(v_s, dst, r[4], r[5], r[6], r[7])


@dataclass(frozen=True)
class TCConfig:
    head_dim: int
    group: int  # query heads per KV head

    @property
    def tile_q(self) -> int:  # query tokens per thread block
        return ROWS // self.group


def tc_config(num_heads: int, num_kv_heads: int, head_dim: int) -> TCConfig:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"tensor-core prefill supports head_dim {HEAD_DIMS}, got {head_dim}")
    group = num_heads // num_kv_heads
    if group > ROWS:
        raise ValueError(f"group {group} (query heads per KV head) exceeds {ROWS}")
    return TCConfig(head_dim, group)


@cached_factory
@functools.cache
def prefill_tc_kernel(cfg: TCConfig, max_registers: int | None = None):
    if SIM:
        raise RuntimeError("the tensor-core prefill kernel links CUDA C++: no CUDA simulator path")
    D, G = cfg.head_dim, cfg.group
    TQ = cfg.tile_q
    RQ = TQ * G  # rows in use (ROWS rounded down to whole tokens)
    N = KV_TILE
    CH = D // 8  # 16-byte chunks per row
    LDQ = D + 8  # padded leading dims (elements): rows start in different banks
    LDK = D + 8
    LDS = N + 4
    LDP = N + 8
    Q_SIZE = ROWS * LDQ
    K_SIZE = max(N * LDK, ROWS * LDP)  # the K buffer holds P after the scores are done
    V_SIZE = N * LDK
    S_SIZE = ROWS * LDS
    NACC = D // 16 * 8  # accumulator floats per lane (D/16 fragments of 8)
    NT = D // 16
    scores_fn = attn_scores[D]
    pv_fn = attn_pv[D]
    store_fn = attn_store_tile
    NEG_INF = float32(-math.inf)
    NCH = N * CH // NUM_THREADS  # 16-byte chunks of K (and of V) per thread per tile
    assert NCH * NUM_THREADS == N * CH and 1 <= NCH <= 4

    def kernel(
        out,  # flat [T * H * D] fp16
        q,  # flat [T * H * D] fp16
        k_cache,  # flat [num_blocks * num_kv_heads * 16 * D] fp16
        v_cache,
        block_tables,  # [B, W] int32
        seq_lens,  # [B] int32
        query_start_loc,  # [B + 1] int32
        scale,
        num_kv_heads,
    ):
        qt = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        q0 = query_start_loc[b]
        q_len = query_start_loc[b + 1] - q0
        t0 = qt * TQ
        if t0 >= q_len:
            return
        seq_len = seq_lens[b]
        ctx0 = seq_len - q_len  # position of the sequence's first query
        H = num_kv_heads * G
        scale2 = float32(scale) * float32(LOG2E)  # softmax in base 2

        q_s = cuda.shared.array(Q_SIZE, float16, alignment=128)
        k_s = cuda.shared.array(K_SIZE, float16, alignment=128)
        v_s = cuda.shared.array(V_SIZE, float16, alignment=128)
        s_s = cuda.shared.array(S_SIZE, float32, alignment=128)
        rowmap = cuda.shared.array(256, float32, alignment=128)
        alpha_s = cuda.shared.array(ROWS, float32, alignment=128)

        for idx in range(tid, ROWS * CH, NUM_THREADS):
            r = idx // CH
            ch = idx - r * CH
            qi = t0 + r // G
            if r < RQ and qi < q_len:
                src = (int64(q0 + qi) * H + kvh * G + r % G) * D + ch * 8
                copy16(q_s, r * LDQ + ch * 8, q, src)
            else:
                for e in range(8):
                    q_s[r * LDQ + ch * 8 + e] = float16(0.0)
        for i in range(tid, 256, NUM_THREADS):
            rowmap[i] = float32(i // 16)

        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)

        # Softmax state of this lane's row (two lanes per row, each holding half the keys).
        my_r = lane >> 1
        half = lane & 1
        row = warp * 16 + my_r
        row_ok = row < RQ and t0 + row // G < q_len
        qpos = ctx0 + t0 + row // G
        m = NEG_INF
        l_sum = float32(0.0)

        q_ptr = ffi.from_buffer(q_s)
        k_ptr = ffi.from_buffer(k_s)
        v_ptr = ffi.from_buffer(v_s)
        s_ptr = ffi.from_buffer(s_s)
        acc_ptr = ffi.from_buffer(acc)
        rowmap_ptr = ffi.from_buffer(rowmap)
        alpha_ptr = ffi.from_buffer(alpha_s)

        last_q = min(t0 + TQ, q_len) - 1
        kv_end = ctx0 + last_q + 1  # keys the tile's last query sees
        # Thread tid's chunks of a tile: idx = tid + j * NUM_THREADS, j < NCH. Their words stay
        # in registers (r0..r3) from the load, issued one tile ahead, to the store into shared
        # memory.
        src = (k_cache, v_cache, block_tables, b, kvh, num_kv_heads, seq_len)
        z = uint32(0)
        r1 = r2 = r3 = (z, z, z, z, z, z, z, z)  # those past NCH stay unused
        r0 = fetch_kv(src, 0, tid, CH, D)
        if NCH > 1:
            r1 = fetch_kv(src, 0, tid + NUM_THREADS, CH, D)
        if NCH > 2:
            r2 = fetch_kv(src, 0, tid + 2 * NUM_THREADS, CH, D)
        if NCH > 3:
            r3 = fetch_kv(src, 0, tid + 3 * NUM_THREADS, CH, D)
        for kv0 in range(0, kv_end, N):
            cuda.syncthreads()  # the previous tile's K/P and V are fully used
            store_kv(k_s, v_s, r0, tid, CH, LDK)
            if NCH > 1:
                store_kv(k_s, v_s, r1, tid + NUM_THREADS, CH, LDK)
            if NCH > 2:
                store_kv(k_s, v_s, r2, tid + 2 * NUM_THREADS, CH, LDK)
            if NCH > 3:
                store_kv(k_s, v_s, r3, tid + 3 * NUM_THREADS, CH, LDK)
            nxt = kv0 + N
            if nxt < kv_end:  # the next tile's loads, in flight during this tile's work
                r0 = fetch_kv(src, nxt, tid, CH, D)
                if NCH > 1:
                    r1 = fetch_kv(src, nxt, tid + NUM_THREADS, CH, D)
                if NCH > 2:
                    r2 = fetch_kv(src, nxt, tid + 2 * NUM_THREADS, CH, D)
                if NCH > 3:
                    r3 = fetch_kv(src, nxt, tid + 3 * NUM_THREADS, CH, D)
            cuda.syncthreads()

            scores_fn(
                s_ptr, int32(warp * 16 * LDS), LDS, q_ptr, int32(warp * 16 * LDQ), LDQ, k_ptr, LDK
            )
            cuda.syncthreads()  # every warp is done with K: its buffer now takes P

            # Online softmax: this lane covers keys half*16 .. half*16+15 of its row.
            sbase = row * LDS + half * 16
            pbase = row * LDP + half * 16
            tmax = NEG_INF
            for c in range(16):
                val = s_s[sbase + c] * scale2
                if not row_ok or kv0 + half * 16 + c > qpos:
                    val = NEG_INF
                s_s[sbase + c] = val
                tmax = max(tmax, val)
            tmax = max(tmax, cuda.shfl_xor_sync(0xFFFFFFFF, tmax, 1))
            m_new = max(m, tmax)
            alpha = float32(1.0)
            psum = float32(0.0)
            if m_new == NEG_INF:  # nothing visible yet (a padding row)
                for c in range(16):
                    k_s[pbase + c] = float16(0.0)
            else:
                alpha = math.exp2(m - m_new)
                for c in range(16):
                    p16 = float16(math.exp2(s_s[sbase + c] - m_new))
                    k_s[pbase + c] = p16
                    psum += float32(p16)  # the sum of exactly what multiplies V
            psum += cuda.shfl_xor_sync(0xFFFFFFFF, psum, 1)
            l_sum = l_sum * alpha + psum
            m = m_new
            if half == 0:
                alpha_s[row] = alpha
            cuda.syncwarp()

            pv_fn(
                acc_ptr,
                k_ptr,
                int32(warp * 16 * LDP),
                LDP,
                v_ptr,
                LDK,
                rowmap_ptr,
                alpha_ptr,
                int32(warp * 16),
            )
            cuda.syncwarp()  # every lane has read alpha_s before it is rewritten

        # Normalise and write this warp's 16 rows, one 16 x 16 column tile at a time.
        if half == 0:
            alpha_s[row] = float32(1.0) / l_sum if l_sum > 0.0 else float32(0.0)
        cuda.syncwarp()
        obase = (int64(q0 + t0 + row // G) * H + kvh * G + row % G) * D + half * 8
        for j in range(NT):
            store_fn(
                acc_ptr,
                int32(j),
                s_ptr,
                int32(warp * 16 * LDS),
                LDS,
                rowmap_ptr,
                alpha_ptr,
                int32(warp * 16),
            )
            cuda.syncwarp()
            if row_ok:
                for e in range(8):
                    out[obase + j * 16 + e] = float16(s_s[row * LDS + half * 8 + e])
            cuda.syncwarp()

    opts = {} if max_registers is None else {"max_registers": max_registers}
    return cuda.jit(fastmath=False, **opts)(kernel)


def paged_attention_tc_cuda(
    q,  # [T, H, D] fp16
    k_cache,  # [num_blocks, num_kv_heads, 16, D] fp16
    v_cache,
    block_tables,  # [B, W] int32
    seq_lens,  # [B] int32
    query_start_loc,  # [B + 1] int32
    scale: float,
    out=None,
    *,
    max_query_len: int | None = None,
    max_registers: int | None = None,
):
    """Causal paged attention with tensor cores on torch's current stream; returns out [T, H, D].

    max_query_len: the longest q_len in the batch; it fixes the grid. When absent it is read
    from query_start_loc, which synchronises with the host (pass it from the batch plan).
    max_registers: a register cap for the kernel (None: ptxas's choice, 255 for head_dim 128 and
    215 for 64 on sm_70 without spills, 2 blocks of 128 threads per SM). A benchmarking knob: at
    8 x 1024 tokens on an H200 caps of 128 and 96 (4 and 5 blocks per SM) measured within the
    run-to-run spread (e6ef8ad, with the direct K/V fill of that version, ~170 registers)."""
    import torch
    from voltserve.kernels.numba_common import current_stream, dev

    T, H, D = q.shape
    _, kvh, block_size, d2 = k_cache.shape
    if block_size != BLOCK_SIZE or d2 != D or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
            f"[blocks, kv_heads, {BLOCK_SIZE}, {D}]"
        )
    if q.dtype != torch.float16 or k_cache.dtype != torch.float16 or v_cache.dtype != torch.float16:
        raise TypeError(f"fp16 only, got q {q.dtype}, cache {k_cache.dtype}/{v_cache.dtype}")
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    cfg = tc_config(H, kvh, D)
    B = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp16 tensor shaped like q")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    if B == 0 or T == 0 or max_query_len == 0:
        return out
    q = q.contiguous()
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (16-byte vector loads)")
    grid = ((max_query_len + cfg.tile_q - 1) // cfg.tile_q, kvh, B)
    prefill_tc_kernel(cfg, max_registers)[grid, NUM_THREADS, current_stream()](
        dev(out.view(-1)),
        dev(q.view(-1)),
        dev(k_cache.view(-1)),
        dev(v_cache.view(-1)),
        dev(block_tables.contiguous()),
        dev(seq_lens),
        dev(query_start_loc),
        float(scale),
        kvh,
    )
    return out


def paged_attention_cuda(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    out=None,
    *,
    max_query_len: int | None = None,
):
    """The dispatch entry for prefill attention: tensor cores where this kernel covers the shape
    (head dims 64/128, groups up to ROWS), the plain tiled kernel otherwise.
    VOLTSERVE_PREFILL_TC=0 forces the plain kernel (for comparisons)."""
    import os

    from voltserve.kernels.prefill_attention import paged_attention_cuda as plain

    group = q.shape[1] // k_cache.shape[1]
    use_tc = os.environ.get("VOLTSERVE_PREFILL_TC", "1") != "0"
    fn = paged_attention_tc_cuda if use_tc and q.shape[2] in HEAD_DIMS and group <= ROWS else plain
    return fn(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        max_query_len=max_query_len,
    )


# ---------------------------------------------------------------------------------------------
# The single-tile building block (tests and check-kernels).

if not SIM:

    @cached
    @cuda.jit
    def wmma_gemm16_kernel(d, a, b, k, b_col):
        """One warp: d[16, 16] f32 = a[16, k] f16 @ b via shared memory (b [k, 16] row-major, or
        b_col != 0: b given transposed as [16, k]). k <= 64, a multiple of 16."""
        a_s = cuda.shared.array(1024, float16, alignment=128)
        b_s = cuda.shared.array(1024, float16, alignment=128)
        d_s = cuda.shared.array(256, float32, alignment=128)
        tid = cuda.threadIdx.x
        for i in range(tid, 16 * k, 32):
            a_s[i] = a[i]
            b_s[i] = b[i]
        cuda.syncwarp()
        wmma_gemm16(ffi.from_buffer(d_s), ffi.from_buffer(a_s), ffi.from_buffer(b_s), k, b_col)
        cuda.syncwarp()
        for i in range(tid, 256, 32):
            d[i] = d_s[i]

    # Representative instances that `voltserve check-kernels` compiles (see kernels/registry.py).
    prefill_tc_kernel_d128_g4 = prefill_tc_kernel(TCConfig(128, 4))
    prefill_tc_kernel_d64_g7 = prefill_tc_kernel(TCConfig(64, 7))
    prefill_tc_kernel_d128_g1 = prefill_tc_kernel(TCConfig(128, 1))
