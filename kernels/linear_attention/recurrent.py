"""Decode: the gated delta rule for one token of each request of a batch (1-256 requests),
state read once from the pool and written back in place (see __init__ for the math and pools).

Kernel design (CUDA cores: per request and head the step is two matrix-vector products and a
rank-one update of the fp32 state, 4 flops per 4-byte state element read and written, so it is
bound by the state's bytes; tensor cores have nothing to do). A block owns one (request, value
head, 32-column tile of the state): 128 threads in 4 warps, lane = state column (a warp reads a
128-byte row segment, coalesced), warp w = rows 32 w .. 32 w + 31 (held in registers between
the read and the write). Per block: the state tile's loads are issued first, all of them (their
round trip overlaps the rest of the prologue), then every other input (q, k, v, a, b and the
head's constants: no global load waits behind a barrier); q and k are L2-normalised (one block
reduction of both sums), g and beta computed from a and b (gating.gates); the tile is
decayed, S^T k reduced over rows (per-warp partials through shared memory), the rank-one update
applied, S^T q reduced the same way, and the tile written back. Grid: (Dv / 32, Hv, batch) =
192 blocks at batch 1 for Qwen3.5-27B (48 heads, Dv 128).

At batch 64 and up the kernel is as much issue-bound as bytes-bound unless its addressing is
cheap: a thread makes 64 state accesses and 64 shared reads. So a warp's 32 rows are
contiguous, a warp whose rows all lie inside the head (every warp at Dk = 128) loads and stores
them in straight-line code (vec_io.ld1 / st1: no wraparound code, so each address is the last
one plus the row stride, two instructions), and shared memory is indexed unsigned. SASS of the
cc 7.0 PTX for sm_90, fp16 inputs: about 1,550 instructions a thread on that path and 66
registers, where indexing as plain numba arrays (rows w, w + 4, ..., clamped) took about 3,350
and 77.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda
from voltserve.kernels.linear_attention.gating import gates, gates_ref
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import (
    block_sum2,
    current_stream,
    float32,
    launch,
    uidx,
)
from voltserve.kernels.runtime.vec_io import ld1, st1

L2_EPS = 1e-6  # transformers' l2norm (as in flash-linear-attention)
COLS = 32  # state columns a block owns (one per lane)
WARPS = 4
THREADS = WARPS * 32
# key dims: rows a thread keeps = MAX_DK / WARPS; == THREADS, so each thread stages one q and
# one k element
MAX_DK = 128
ROWS = MAX_DK // WARPS


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule_decode_ref(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    a: torch.Tensor,  # [B, Hv]
    b: torch.Tensor,  # [B, Hv]
    A_log: torch.Tensor,  # [Hv] fp32
    dt_bias: torch.Tensor,  # [Hv] fp32
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] fp32, updated in place
    slots: torch.Tensor,  # [B] int64, -1 = padding row
) -> torch.Tensor:
    """One decode step for every request; returns o [B, Hv, Dv] in v's dtype (zeros on padding
    rows) and writes each request's new state into state_pool[slots[i]]."""
    B, Hk, Dk = q.shape
    Hv = v.shape[1]
    out = torch.zeros_like(v)
    live = (slots >= 0).nonzero().flatten()
    if live.numel() == 0:
        return out
    idx = slots[live].long()
    rep = Hv // Hk
    qn = l2norm_ref(q[live].float()).repeat_interleave(rep, dim=1) / math.sqrt(Dk)
    kn = l2norm_ref(k[live].float()).repeat_interleave(rep, dim=1)
    g, beta = gates_ref(a[live], b[live], A_log, dt_bias)
    S = state_pool[idx] * g.exp()[..., None, None]  # [n, Hv, Dk, Dv]
    kv = torch.einsum("nhkv,nhk->nhv", S, kn)
    delta = (v[live].float() - kv) * beta[..., None]
    S = S + kn[..., :, None] * delta[..., None, :]
    state_pool[idx] = S
    out[live] = torch.einsum("nhkv,nhk->nhv", S, qn).to(v.dtype)
    return out


@cached
@cuda.jit
def gdn_decode_kernel(q, k, v, a, b, a_log, dt_bias, state_pool, slots, out, scale):
    col_tile, h, req = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane, warp = tid & 31, tid >> 5
    Dk, Dv = q.shape[2], v.shape[2]
    hk = h // (v.shape[1] // q.shape[1])
    j = col_tile * COLS + lane
    slot = slots[req]
    if slot < 0:  # padding row: the whole block leaves before any barrier
        if warp == 0 and j < Dv:
            out[req, h, j] = 0.0
        return
    # The state tile's loads come first and all together: they need neither q, k nor the gates,
    # so their round trip overlaps the norms' and the gates'. Rows past the head are not read
    # (zero); a column past it reads the head's last column, zeroed with the decay below.
    ok = j < Dv
    jc = min(j, Dv - 1)
    row0 = warp * ROWS
    u0 = uidx(row0)  # unsigned shared-memory indices: no negative-index wraparound code
    nrows = max(min(Dk - row0, ROWS), 0)  # this warp's rows inside the head
    s = cuda.local.array(ROWS, float32)
    if nrows == ROWS:  # every row (the model shapes): straight-line loads, no guard
        for r in range(ROWS):
            s[r] = ld1(state_pool, (slot, h, row0 + r, jc))
    else:
        for r in range(ROWS):
            x = float32(0.0)
            if r < nrows:
                x = ld1(state_pool, (slot, h, row0 + r, jc))
            s[r] = x
    # Every other input next, before the first barrier (a load after one is a round trip of
    # its own on the critical path).
    qv = float32(0.0)
    kv = float32(0.0)
    if tid < Dk:
        qv = float32(q[req, hk, tid])
        kv = float32(k[req, hk, tid])
    vj = float32(v[req, h, jc])
    a_, b_, alog, dtb = a[req, h], b[req, h], a_log[h], dt_bias[h]
    qs = cuda.shared.array(MAX_DK, float32)
    ks = cuda.shared.array(MAX_DK, float32)
    part = cuda.shared.array((WARPS, COLS), float32)
    part2 = cuda.shared.array((WARPS, COLS), float32)  # the second reduction's: no barrier
    scratch2 = cuda.shared.array((2, 32), float32)
    qq, kk = block_sum2(qv * qv, kv * kv, scratch2)
    qinv = float32(1.0) / math.sqrt(qq + float32(L2_EPS))
    kinv = float32(1.0) / math.sqrt(kk + float32(L2_EPS))
    qs[tid] = qv * qinv * scale  # 0 past Dk: THREADS == MAX_DK
    ks[tid] = kv * kinv
    g, beta = gates(a_, b_, alog, dtb, b)
    decay = float32(math.exp(g)) if ok else float32(0.0)
    cuda.syncthreads()

    acc = float32(0.0)
    for r in range(ROWS):
        x = s[r] * decay
        s[r] = x
        acc += x * ks[u0 + uidx(r)]
    part[warp, lane] = acc
    cuda.syncthreads()
    kvm = part[0, lane]
    for w in range(1, WARPS):
        kvm += part[w, lane]
    delta = float32(0.0)
    if ok:
        delta = (vj - kvm) * beta
    acc = float32(0.0)
    for r in range(ROWS):
        sv = s[r] + ks[u0 + uidx(r)] * delta
        s[r] = sv
        acc += sv * qs[u0 + uidx(r)]
    if ok and nrows == ROWS:
        for r in range(ROWS):
            st1(state_pool, (slot, h, row0 + r, j), s[r])
    elif ok:
        for r in range(ROWS):
            if r < nrows:
                st1(state_pool, (slot, h, row0 + r, j), s[r])
    part2[warp, lane] = acc
    cuda.syncthreads()
    if warp == 0 and ok:
        o = part2[0, lane]
        for w in range(1, WARPS):
            o += part2[w, lane]
        out[req, h, j] = o


def check_shapes(q: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> None:
    Hk, Dk = q.shape[-2:]
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} must be a multiple of key heads {Hk}")
    if Dk > MAX_DK:
        raise ValueError(f"key head dim {Dk} exceeds the kernels' {MAX_DK}")
    if tuple(state_pool.shape[1:]) != (Hv, Dk, Dv) or state_pool.dtype != torch.float32:
        raise ValueError(
            f"state pool {tuple(state_pool.shape)} {state_pool.dtype}: want [slots, {Hv}, {Dk},"
            f" {Dv}] float32"
        )


def decode_launches(q, k, v, a, b, A_log, dt_bias, state_pool, slots, out) -> list[tuple]:
    """(kernel, grid, block, args) of the decode step (tests run the same list in the
    simulator)."""
    B, Hv, Dv = v.shape
    if B == 0:
        return []
    scale = np.float32(q.shape[2] ** -0.5)
    return [
        (
            gdn_decode_kernel,
            ((Dv + COLS - 1) // COLS, Hv, B),
            THREADS,
            (q, k, v, a, b, A_log, dt_bias, state_pool, slots, out, scale),
        )
    ]


def gated_delta_rule_decode_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gated_delta_rule_decode_ref; one launch, no host sync (graph-safe)."""
    if not on_gpu(q):
        raise ValueError("gated_delta_rule_decode_cuda needs CUDA tensors")
    check_shapes(q, v, state_pool)
    out = torch.empty_like(v)
    stream = current_stream()
    for kernel, grid, block, args in decode_launches(
        q, k, v, a, b, A_log, dt_bias, state_pool, slots, out
    ):
        launch(kernel, grid, block, args, stream)
    return out
