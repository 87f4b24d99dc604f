"""Paged decode attention: one query token per sequence, numba.cuda for SM70 and newer.

Meaning: `paged_decode_attention_ref` in attention_ref.py. Layout: kv_cache.py.

Work split. One thread block owns (sequence, KV head, context partition) and ALL the query heads
that share that KV head (grouped-query), so each K/V element is read from memory once. Long
contexts are cut into partitions (512 tokens by default) so that even batch 1 gives enough blocks
to fill the GPU; a second kernel merges the partitions (rescaling each partial sum by
exp(partial max - global max)). When the context bound fits one partition the first kernel
normalises and writes the output itself and the merge is skipped.

Inside a block: lanes are grouped per token, each lane owning one 16-byte chunk (8 dims) of the
token's K/V row, so a warp reads whole contiguous rows; a warp takes one 16-token KV block at a
time and issues up to 8 independent 16-byte loads per lane before using any of them. QK dot
products are finished with warp shuffles; softmax runs over the partition's scores in shared
memory; PV accumulates in fp32 registers (G x 8 per lane) and is reduced across lanes (shuffles)
and warps (shared atomics) once per partition.

CUDA graphs: the grid depends only on an upper bound of the context (`max_seq_len`, by default
the block table width x block size), never on the values of seq_lens. Partitions past a
sequence's length exit at once; the merge reads each sequence's own partition count; a
sequence of length 0 (graph padding) gets a zero output. No host sync anywhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, int64
from voltserve.kernels.attention_common import (
    as_numba,
    ld_f16x8,
    next_pow2,
    shfl_xor,
    torch_stream,
)

BLOCK_SIZE = 16  # tokens per KV block (fixed by the block manager)
DEFAULT_PARTITION = 512
MAX_HEADS_PER_BLOCK = 8  # query heads per thread block; larger groups are split (registers)


@dataclass(frozen=True)
class DecodeConfig:
    head_dim: int
    group: int  # query heads handled by one thread block (all share one KV head)
    split: int  # thread blocks per KV head along the heads (num_heads // num_kv_heads // group)
    partition: int  # context tokens per thread block
    num_threads: int


def decode_config(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    partition_size: int | None = None,
    num_threads: int = 128,
) -> DecodeConfig:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 8 in [8, 256]")
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads {num_threads} must be a multiple of 32 in [32, 1024]")
    ratio = num_heads // num_kv_heads
    group = max(g for g in range(1, min(ratio, MAX_HEADS_PER_BLOCK) + 1) if ratio % g == 0)
    partition = partition_size or DEFAULT_PARTITION
    if partition % BLOCK_SIZE:
        raise ValueError(f"partition_size {partition} must be a multiple of {BLOCK_SIZE}")
    return DecodeConfig(head_dim, group, ratio // group, partition, num_threads)


@functools.cache
def decode_kernel(cfg: DecodeConfig, direct: bool):
    """The partition kernel for one shape. direct=True: a single partition covers the context, so
    normalise and write `out`; otherwise write the partial (max, sum, unnormalised out)."""
    D, G, PART, NT = cfg.head_dim, cfg.group, cfg.partition, cfg.num_threads
    SPLIT = cfg.split
    NW = NT // 32
    NCHUNK = D // 8  # 16-byte chunks per token row
    TPT = next_pow2(NCHUNK)  # lanes per token (power of two so shuffles stay in the group)
    LOG_TPT = TPT.bit_length() - 1
    TPP = 32 // TPT  # tokens per warp pass
    LOG_TPP = TPP.bit_length() - 1
    NPASS = BLOCK_SIZE // TPP  # passes per KV block
    BATCH = min(NPASS, 8)  # passes whose loads are in flight together
    NBATCH = NPASS // BATCH
    ROW = BLOCK_SIZE * D  # elements of one (block, KV head)
    GD = G * D
    G8 = G * 8
    B8 = BATCH * 8
    DIRECT = direct

    @cuda.jit(fastmath=False)
    def kernel(
        out,  # [B, H, D] fp16 (direct only)
        q,  # [B, H, D] fp16
        k_cache,  # flat view of [num_blocks, num_kv_heads, 16, D] fp16
        v_cache,
        block_tables,  # [B, W] int32
        seq_lens,  # [B] int32
        scale,  # float32
        num_kv_heads,  # int32
        max_logits,  # [B, H, P] fp32 (split only)
        exp_sums,  # [B, H, P] fp32
        tmp_out,  # [B, H, P, D] fp32
    ):
        part = cuda.blockIdx.x
        y = cuda.blockIdx.y
        b = cuda.blockIdx.z
        kvh = y // SPLIT
        h0 = y * G  # first query head of this block
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        seq_len = seq_lens[b]
        start = part * PART
        if start >= seq_len:
            if DIRECT:  # only seq_len == 0 gets here: padding rows read nothing and write zeros
                for i in range(tid, GD, NT):
                    out[b, h0 + i // D, i % D] = 0.0
            return
        n_tok = min(PART, seq_len - start)
        n_blk = (n_tok + BLOCK_SIZE - 1) // BLOCK_SIZE
        blk0 = start // BLOCK_SIZE

        logits = cuda.shared.array((G, PART), float32)
        acc_s = cuda.shared.array(GD, float32)
        m_s = cuda.shared.array(G, float32)
        l_s = cuda.shared.array(G, float32)
        for i in range(tid, GD, NT):
            acc_s[i] = 0.0

        sub = lane // TPT  # token within a pass
        c = lane % TPT  # 16-byte chunk of the row
        active = c < NCHUNK
        fscale = float32(scale)
        qr = cuda.local.array(G8, float32)
        for g in range(G):
            for j in range(8):
                qr[g * 8 + j] = 0.0
                if active:
                    qr[g * 8 + j] = float32(q[b, h0 + g, c * 8 + j]) * fscale
        buf = cuda.local.array(B8, float32)

        # Scores: logits[g, t] = q_g . k_t (scale folded into q).
        for i in range(warp, n_blk, NW):
            base = (int64(block_tables[b, blk0 + i]) * num_kv_heads + kvh) * ROW
            for bt in range(NBATCH):
                for ps in range(BATCH):
                    if active:
                        t = (bt * BATCH + ps) * TPP + sub
                        vals = ld_f16x8(k_cache, base + t * D + c * 8)
                        for j in range(8):
                            buf[ps * 8 + j] = vals[j]
                    else:
                        for j in range(8):
                            buf[ps * 8 + j] = 0.0
                for ps in range(BATCH):
                    tpos = i * BLOCK_SIZE + (bt * BATCH + ps) * TPP + sub
                    for g in range(G):
                        s = float32(0.0)
                        for j in range(8):
                            s += qr[g * 8 + j] * buf[ps * 8 + j]
                        for k in range(LOG_TPT):
                            s += shfl_xor(s, TPT >> (k + 1))
                        if c == 0 and tpos < n_tok:
                            logits[g, tpos] = s
        cuda.syncthreads()

        # Softmax numerators in place, with each head's max and sum.
        for g in range(warp, G, NW):
            m = float32(-math.inf)
            for t in range(lane, n_tok, 32):
                m = max(m, logits[g, t])
            for k in range(5):
                m = max(m, shfl_xor(m, 16 >> k))
            total = float32(0.0)
            for t in range(lane, n_tok, 32):
                e = math.exp(logits[g, t] - m)
                logits[g, t] = e
                total += e
            for k in range(5):
                total += shfl_xor(total, 16 >> k)
            if lane == 0:
                m_s[g] = m
                l_s[g] = total
        cuda.syncthreads()

        # PV: each lane accumulates its 8 dims for every head over its tokens.
        acc = cuda.local.array(G8, float32)
        for j in range(G8):
            acc[j] = 0.0
        for i in range(warp, n_blk, NW):
            base = (int64(block_tables[b, blk0 + i]) * num_kv_heads + kvh) * ROW
            for bt in range(NBATCH):
                for ps in range(BATCH):
                    if active:
                        t = (bt * BATCH + ps) * TPP + sub
                        vals = ld_f16x8(v_cache, base + t * D + c * 8)
                        for j in range(8):
                            buf[ps * 8 + j] = vals[j]
                for ps in range(BATCH):
                    tpos = i * BLOCK_SIZE + (bt * BATCH + ps) * TPP + sub
                    # Rows past the context hold stale data (maybe NaN): skip, never multiply by 0.
                    if active and tpos < n_tok:
                        for g in range(G):
                            p = logits[g, tpos]
                            for j in range(8):
                                acc[g * 8 + j] += p * buf[ps * 8 + j]
        for j in range(G8):
            v = acc[j]
            for k in range(LOG_TPP):
                v += shfl_xor(v, TPT << k)
            acc[j] = v
        if sub == 0 and active:
            for g in range(G):
                for j in range(8):
                    cuda.atomic.add(acc_s, g * D + c * 8 + j, acc[g * 8 + j])
        cuda.syncthreads()

        if DIRECT:
            for i in range(tid, GD, NT):
                g = i // D
                out[b, h0 + g, i % D] = acc_s[i] / l_s[g]
        else:
            for i in range(tid, GD, NT):
                tmp_out[b, h0 + i // D, part, i % D] = acc_s[i]
            if tid < G:
                max_logits[b, h0 + tid, part] = m_s[tid]
                exp_sums[b, h0 + tid, part] = l_s[tid]

    return kernel


@cuda.jit
def decode_reduce_kernel(out, max_logits, exp_sums, tmp_out, seq_lens, partition):
    """Merge the partitions of one (sequence, head): grid (H, B)."""
    h = cuda.blockIdx.x
    b = cuda.blockIdx.y
    n_part = (seq_lens[b] + partition - 1) // partition
    m = float32(-math.inf)
    for p in range(n_part):
        m = max(m, max_logits[b, h, p])
    total = float32(0.0)
    for p in range(n_part):
        total += exp_sums[b, h, p] * math.exp(max_logits[b, h, p] - m)
    inv = float32(0.0)
    if total > 0.0:
        inv = float32(1.0) / total
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        a = float32(0.0)
        for p in range(n_part):
            a += tmp_out[b, h, p, d] * math.exp(max_logits[b, h, p] - m)
        out[b, h, d] = a * inv


REDUCE_THREADS = 128


def num_partitions(max_seq_len: int, partition: int) -> int:
    return max(1, (max_seq_len + partition - 1) // partition)


def paged_decode_attention_cuda(
    q,  # [B, H, D] fp16
    k_cache,  # [num_blocks, num_kv_heads, 16, D] fp16
    v_cache,
    block_tables,  # [B, W] int32
    seq_lens,  # [B] int32
    scale: float,
    out=None,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    workspace=None,
    num_threads: int = 128,
):
    """Decode attention on torch's current stream; returns out [B, H, D].

    max_seq_len: an upper bound on every seq_len; it fixes the grid, so a CUDA graph captured
    with it replays correctly for any seq_lens up to it. Default: block_tables width x 16.
    workspace: optional (max_logits [B, H, P], exp_sums [B, H, P], tmp_out [B, H, P, D]) fp32
    with P >= the partition count; allocated from torch's allocator when absent (inside a graph
    capture that memory belongs to the graph's pool)."""
    import torch

    B, H, D = q.shape
    num_blocks, kvh, block_size, d2 = k_cache.shape
    if block_size != BLOCK_SIZE or d2 != D or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
            f"[blocks, kv_heads, {BLOCK_SIZE}, {D}]"
        )
    if q.dtype != torch.float16 or k_cache.dtype != torch.float16 or v_cache.dtype != torch.float16:
        raise TypeError(f"fp16 only, got q {q.dtype}, cache {k_cache.dtype}/{v_cache.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables and seq_lens must be int32")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        raise ValueError("KV caches must be 16-byte aligned (16-byte vector loads)")
    cfg = decode_config(H, kvh, D, partition_size, num_threads)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * BLOCK_SIZE
    n_part = num_partitions(max_seq_len, cfg.partition)
    direct = n_part == 1
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        p_ws = 1 if direct else n_part
        workspace = (
            torch.empty((B, H, p_ws), dtype=torch.float32, device=q.device),
            torch.empty((B, H, p_ws), dtype=torch.float32, device=q.device),
            torch.empty((B, H, p_ws, D), dtype=torch.float32, device=q.device),
        )
    elif not direct and workspace[2].shape[2] < n_part:
        raise ValueError(f"workspace holds {workspace[2].shape[2]} partitions, need {n_part}")
    if B == 0:
        return out
    stream = torch_stream()
    ml, es, tmp = (as_numba(t) for t in workspace)
    sl = as_numba(seq_lens)
    kernel = decode_kernel(cfg, direct)
    grid = (n_part, kvh * cfg.split, B)
    kernel[grid, cfg.num_threads, stream](
        as_numba(out),
        as_numba(q),
        as_numba(k_cache.view(-1)),
        as_numba(v_cache.view(-1)),
        as_numba(block_tables),
        sl,
        float(scale),
        kvh,
        ml,
        es,
        tmp,
    )
    if not direct:
        decode_reduce_kernel[(H, B), REDUCE_THREADS, stream](
            as_numba(out), ml, es, tmp, sl, cfg.partition
        )
    return out


# Representative instances that `voltserve check-kernels` compiles (see kernels/registry.py):
# Llama-3-8B (128 dims, 4 heads per KV head), Qwen2.5-0.5B-like (64 dims, 7 -> split as 7),
# MHA with 256 dims, each in the split and the single-partition form.
decode_kernel_d128_g4 = decode_kernel(decode_config(32, 8, 128), direct=False)
decode_kernel_d128_g4_direct = decode_kernel(decode_config(32, 8, 128), direct=True)
decode_kernel_d64_g7 = decode_kernel(decode_config(14, 2, 64), direct=False)
decode_kernel_d256_g1 = decode_kernel(decode_config(8, 8, 256), direct=False)
