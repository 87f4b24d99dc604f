"""Paged attention for a flat batch of query tokens (prompts, chunked prefill, prefix-cache hits),
numba.cuda for SM70 and newer.

Meaning: `paged_attention_ref` in attention/ref.py: query row i of a sequence with q_len queries
sits at position seq_len - q_len + i and attends causally; head h reads KV head h // group.

Flash-attention style: one thread block owns (sequence, KV head, tile of query tokens) and all
query heads of that KV head, so its tile holds tile_q tokens x group heads = R rows and each K/V
tile is loaded once for all of them. K/V tiles of N tokens stream through shared memory (16-byte
loads from the paged cache, fp16 in shared); scores and the online softmax (running max and sum
per row) are fp32; the output accumulates in fp32 registers, each thread owning a few rows x a
few dims (register tiling: the inner loops read 2 shared values per 4-8 FMAs).

This is the plain CUDA-core path (the one the simulator tests). Volta tensor cores (wmma through
linked PTX) are a later step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, int64
from numba.core.types import float16
from voltserve.kernels.attention.common import check_paged_cache, ld_f16x8
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.numba_common import current_stream, launch

BLOCK_SIZE = 16
TX = 8  # threads along the key / dim axis of a tile


@dataclass(frozen=True)
class PrefillConfig:
    head_dim: int
    group: int  # query heads per KV head
    num_threads: int
    rows_per_thread: int
    cols_per_thread: int  # keys per thread in the score tile

    @property
    def rows(self) -> int:  # R: (token, head) rows per block
        return (self.num_threads // TX) * self.rows_per_thread

    @property
    def tile_q(self) -> int:  # query tokens per block
        return self.rows // self.group

    @property
    def tile_kv(self) -> int:  # N: keys per tile
        return TX * self.cols_per_thread


def prefill_config(
    num_heads: int, num_kv_heads: int, head_dim: int, num_threads: int = 128
) -> PrefillConfig:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim % TX or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 8 in [8, 256]")
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads {num_threads} must be a multiple of 32")
    group = num_heads // num_kv_heads
    ty = num_threads // TX
    # Shared memory stays under the 48 KB static limit: q [R, D+2] + k [N, D+2] + v [N, D] fp16.
    rpt = 4 if head_dim <= 128 else 2
    cpt = 4 if head_dim <= 128 else 2
    while ty * rpt < group:  # a block must hold at least one token's heads
        rpt *= 2
    if ty * rpt > 64 and head_dim > 128:
        raise ValueError(f"group {group} too large for head_dim {head_dim}")
    return PrefillConfig(head_dim, group, num_threads, rpt, cpt)


@cached_factory
@functools.cache
def prefill_kernel(cfg: PrefillConfig):
    D, G, NT = cfg.head_dim, cfg.group, cfg.num_threads
    TY = NT // TX
    RPT, CPT = cfg.rows_per_thread, cfg.cols_per_thread
    R, N, TQ = cfg.rows, cfg.tile_kv, cfg.tile_q
    RQ = TQ * G  # rows in use (R rounded down to whole tokens)
    DPT = D // TX  # output dims per thread
    NCHUNK = D // 8
    DP = D + 2  # padded row (halves): consecutive rows start in different banks
    NP = N + 1
    RC = RPT * CPT
    RD = RPT * DPT
    NEG_INF = float32(-math.inf)

    @cuda.jit(fastmath=False)
    def kernel(
        out,  # [T, H, D] fp16
        q,  # [T, H, D] fp16
        k_cache,  # flat [num_blocks, num_kv_heads, 16, D] fp16
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
        tx = tid % TX
        ty = tid // TX
        q0 = query_start_loc[b]
        q_len = query_start_loc[b + 1] - q0
        t0 = qt * TQ
        if t0 >= q_len:
            return
        seq_len = seq_lens[b]
        ctx0 = seq_len - q_len  # position of the sequence's first query
        fscale = float32(scale)

        q_s = cuda.shared.array((R, DP), float16)
        k_s = cuda.shared.array((N, DP), float16)
        v_s = cuda.shared.array((N, D), float16)
        p_s = cuda.shared.array((R, NP), float32)
        m_s = cuda.shared.array(R, float32)
        l_s = cuda.shared.array(R, float32)
        a_s = cuda.shared.array(R, float32)

        for idx in range(tid, R * D, NT):
            r = idx // D
            d = idx % D
            qi = t0 + r // G
            val = float16(0.0)
            if r < RQ and qi < q_len:
                val = q[q0 + qi, kvh * G + r % G, d]
            q_s[r, d] = val
        for r in range(tid, R, NT):
            m_s[r] = NEG_INF
            l_s[r] = 0.0

        acc = cuda.local.array(RD, float32)
        for i in range(RD):
            acc[i] = 0.0
        s = cuda.local.array(RC, float32)

        last_q = min(t0 + TQ, q_len) - 1
        kv_end = ctx0 + last_q + 1  # keys the tile's last query sees
        for kv0 in range(0, kv_end, N):
            cuda.syncthreads()  # previous tile's k_s / v_s / p_s fully used
            for idx in range(tid, N * NCHUNK, NT):
                t = idx // NCHUNK
                ch = idx % NCHUNK
                pos = kv0 + t
                if pos < seq_len:
                    blk = int64(block_tables[b, pos // BLOCK_SIZE])
                    off = ((blk * num_kv_heads + kvh) * BLOCK_SIZE + pos % BLOCK_SIZE) * D + ch * 8
                    kv = ld_f16x8(k_cache, off)
                    vv = ld_f16x8(v_cache, off)
                    for j in range(8):
                        k_s[t, ch * 8 + j] = float16(kv[j])
                        v_s[t, ch * 8 + j] = float16(vv[j])
                else:  # past the context: zeros, never stale cache data (0 * NaN = NaN)
                    for j in range(8):
                        k_s[t, ch * 8 + j] = float16(0.0)
                        v_s[t, ch * 8 + j] = float16(0.0)
            cuda.syncthreads()

            # Scores for rows ty + TY*i, keys tx + TX*j.
            for i in range(RC):
                s[i] = 0.0
            for d in range(D):
                for i in range(RPT):
                    qv = float32(q_s[ty + TY * i, d])
                    for j in range(CPT):
                        s[i * CPT + j] += qv * float32(k_s[tx + TX * j, d])
            for i in range(RPT):
                r = ty + TY * i
                qpos = ctx0 + t0 + r // G
                for j in range(CPT):
                    c = tx + TX * j
                    val = s[i * CPT + j] * fscale
                    if r >= RQ or kv0 + c > qpos:
                        val = NEG_INF
                    p_s[r, c] = val
            cuda.syncthreads()

            # Online softmax, one thread per row.
            for r in range(tid, R, NT):
                m_old = m_s[r]
                m_new = m_old
                for c in range(N):
                    m_new = max(m_new, p_s[r, c])
                alpha = float32(1.0)
                total = float32(0.0)
                if m_new == NEG_INF:  # nothing visible yet (or a padding row)
                    for c in range(N):
                        p_s[r, c] = 0.0
                else:
                    alpha = math.exp(m_old - m_new)
                    for c in range(N):
                        e = math.exp(p_s[r, c] - m_new)
                        p_s[r, c] = e
                        total += e
                m_s[r] = m_new
                l_s[r] = l_s[r] * alpha + total
                a_s[r] = alpha
            cuda.syncthreads()

            # O = O * alpha + P V for rows ty + TY*i, dims tx + TX*j.
            for i in range(RPT):
                alpha = a_s[ty + TY * i]
                for j in range(DPT):
                    acc[i * DPT + j] *= alpha
            for t in range(N):
                for i in range(RPT):
                    p = p_s[ty + TY * i, t]
                    for j in range(DPT):
                        acc[i * DPT + j] += p * float32(v_s[t, tx + TX * j])

        cuda.syncthreads()
        for i in range(RPT):
            r = ty + TY * i
            qi = t0 + r // G
            if r < RQ and qi < q_len:
                total = l_s[r]
                inv = float32(0.0)
                if total > 0.0:
                    inv = float32(1.0) / total
                for j in range(DPT):
                    out[q0 + qi, kvh * G + r % G, tx + TX * j] = acc[i * DPT + j] * inv

    return kernel


def paged_attention_cuda(
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
    num_threads: int = 128,
):
    """Causal paged attention on torch's current stream; returns out [T, H, D].

    max_query_len: the longest q_len in the batch; it fixes the grid. When absent it is read
    from query_start_loc, which synchronises with the host (pass it from the batch plan)."""
    import torch

    T, H, D = q.shape
    kvh = k_cache.shape[1]
    check_paged_cache(
        q,
        k_cache,
        v_cache,
        BLOCK_SIZE,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    cfg = prefill_config(H, kvh, D, num_threads)
    B = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    if B == 0 or T == 0 or max_query_len == 0:
        return out
    q = q.contiguous()
    grid = ((max_query_len + cfg.tile_q - 1) // cfg.tile_q, kvh, B)
    args = (
        out,
        q,
        k_cache.view(-1),
        v_cache.view(-1),
        block_tables.contiguous(),
        seq_lens,
        query_start_loc,
        float(scale),
        kvh,
    )
    launch(prefill_kernel(cfg), grid, cfg.num_threads, args, current_stream())
    return out


# Representative instances that `voltserve check-kernels` compiles (see kernels/registry.py).
prefill_kernel_d128_g4 = prefill_kernel(prefill_config(32, 8, 128))
prefill_kernel_d64_g7 = prefill_kernel(prefill_config(14, 2, 64))
prefill_kernel_d256_g1 = prefill_kernel(prefill_config(8, 8, 256))
