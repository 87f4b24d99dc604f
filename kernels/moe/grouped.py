"""Grouped MoE expert GEMMs for batched decode and prefill (T > 8 tokens), without a host sync.

The P = T * k (token, expert) pairs are grouped by expert on the device (moe_routing.moe_align_ref:
a stable sort and a scan), and each projection is ONE launch over all experts: block (tile,
column block) multiplies one expert's tile of BM sorted rows by that expert's weight rows. The
grid is sized by the bound max_tiles(P, E, BM), known from T alone; blocks handed a tile past the
last one return at once. So the whole path is graph-capturable at every decode batch size.

1. gate_up: h_sorted[s, j] = silu(x[tok(s)] . w13[e, j]) * (x[tok(s)] . w13[e, I + j]) for sorted
   position s (tok(s) = order[s] // k: the rows of x are gathered as the tile is loaded). A block
   owns BN_PAIRS = 32 outputs j, i.e. 32 gate rows and the 32 matching up rows.
2. down: y[pair, n] = w[pair] * (h_sorted[s] . w2[e, n]) written to the pair's own row of a
   [P, H] fp32 buffer (pair = order[s]); then one reduction over the k slots of each token (a
   torch sum) gives out [T, H], rounded once.

Tiles: BM = 16 rows x BN = 64 weight rows x BK = 64, staged through shared memory as fp32
(16-byte global loads, one [rows][BK + 1] layout per operand so the inner loop is free of bank
conflicts); 128 threads, each accumulating 2 rows x 4 columns in fp32. This is a SIMT kernel:
Volta's tensor cores (the inline-PTX WMMA route of wmma_ptx.cu) are the next step for prefill,
where it is compute-bound; batched decode is weight-bound and reads each touched expert's
weights once per tile.

The reference is kernels/moe/experts.py's moe_experts_ref.
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.moe.routing import moe_align_ref
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch, round_like
from voltserve.kernels.runtime.vec_io import VEC, ZERO8, ld8

BM = 16  # sorted rows per tile
BN = 64  # weight rows per block (gate_up: 32 gate + 32 up rows)
BN_PAIRS = BN // 2
BK = 64  # reduction depth per shared-memory stage
THREADS = 128
PAD = BK + 1  # shared row stride (floats)


@cuda.jit(device=True, inline="always")
def _tile_of(tile, tile_expert, tile_first, expert_start):
    """(expert, first sorted row, end row) of a tile; expert = -1 past the last tile."""
    e = tile_expert[tile]
    if e >= tile_first.shape[0]:
        return -1, 0, 0
    r0 = expert_start[e] + (tile - tile_first[e]) * BM
    r1 = min(r0 + BM, expert_start[e + 1])
    return e, r0, r1


@cuda.jit(device=True, inline="always")
def _st8_shared(sh, r, c, v):
    sh[r, c] = v[0]
    sh[r, c + 1] = v[1]
    sh[r, c + 2] = v[2]
    sh[r, c + 3] = v[3]
    sh[r, c + 4] = v[4]
    sh[r, c + 5] = v[5]
    sh[r, c + 6] = v[6]
    sh[r, c + 7] = v[7]


@cached
@cuda.jit
def moe_grouped_gate_up_kernel(
    x, w13, order, expert_start, tile_first, tile_expert, top_k, h_sorted
):
    # x [T, H], w13 [E, 2I, H], order [P] int32, h_sorted [P, I]
    tile = cuda.blockIdx.x
    e, r0, r1 = _tile_of(tile, tile_expert, tile_first, expert_start)
    if e < 0:
        return  # the whole block leaves: no barrier is reached by only some threads
    a_sh = cuda.shared.array((BM, PAD), float32)
    b_sh = cuda.shared.array((BN, PAD), float32)
    tid = cuda.threadIdx.x
    tx = tid & 15
    ty = tid >> 4
    # Rows ty and ty + 8 both past the tile's end: skip the products (small tiles are the rule
    # in batched decode; whole warps skip, as a warp holds two values of ty). The loads and
    # barriers stay the same for every thread.
    active = r0 + ty < r1
    H = x.shape[1]
    inter = h_sorted.shape[1]
    j0 = cuda.blockIdx.y * BN_PAIRS
    # This thread's A chunk: row ar, columns ac..ac+8 of the stage.
    ar = tid >> 3
    ac = (tid & 7) * VEC
    arow = r0 + ar
    tok = -1
    if arow < r1:
        tok = order[arow] // top_k
    g00 = float32(0.0)
    g01 = float32(0.0)
    g10 = float32(0.0)
    g11 = float32(0.0)
    u00 = float32(0.0)
    u01 = float32(0.0)
    u10 = float32(0.0)
    u11 = float32(0.0)
    kb = 0
    while kb < H:
        col = kb + ac
        if tok >= 0 and col < H:
            _st8_shared(a_sh, ar, ac, ld8(x, (tok, col)))
        else:
            _st8_shared(a_sh, ar, ac, ZERO8)
        for i in range(BN * BK // VEC // THREADS):  # 4 weight chunks per thread
            q = tid + i * THREADS
            br = q >> 3
            bc = (q & 7) * VEC
            j = j0 + (br & (BN_PAIRS - 1))
            wrow = j if br < BN_PAIRS else inter + j
            if j < inter and kb + bc < H:
                _st8_shared(b_sh, br, bc, ld8(w13, (e, wrow, kb + bc)))
            else:
                _st8_shared(b_sh, br, bc, ZERO8)
        cuda.syncthreads()
        for kk in range(BK if active else 0):
            a0 = a_sh[ty, kk]
            a1 = a_sh[ty + 8, kk]
            bg0 = b_sh[tx, kk]
            bg1 = b_sh[tx + 16, kk]
            bu0 = b_sh[BN_PAIRS + tx, kk]
            bu1 = b_sh[BN_PAIRS + tx + 16, kk]
            g00 += a0 * bg0
            g01 += a0 * bg1
            g10 += a1 * bg0
            g11 += a1 * bg1
            u00 += a0 * bu0
            u01 += a0 * bu1
            u10 += a1 * bu0
            u11 += a1 * bu1
        cuda.syncthreads()
        kb += BK
    s0 = r0 + ty
    s1 = s0 + 8
    ja = j0 + tx
    jb = ja + 16
    if s0 < r1:
        if ja < inter:
            h_sorted[s0, ja] = _silu_mul(
                round_like(g00, h_sorted), round_like(u00, h_sorted), h_sorted
            )
        if jb < inter:
            h_sorted[s0, jb] = _silu_mul(
                round_like(g01, h_sorted), round_like(u01, h_sorted), h_sorted
            )
    if s1 < r1:
        if ja < inter:
            h_sorted[s1, ja] = _silu_mul(
                round_like(g10, h_sorted), round_like(u10, h_sorted), h_sorted
            )
        if jb < inter:
            h_sorted[s1, jb] = _silu_mul(
                round_like(g11, h_sorted), round_like(u11, h_sorted), h_sorted
            )


@cached
@cuda.jit
def moe_grouped_down_kernel(
    h_sorted, w2, order, expert_start, tile_first, tile_expert, wts_flat, y_pairs
):
    # h_sorted [P, I], w2 [E, H, I], wts_flat [P] fp32, y_pairs [P, H] fp32
    tile = cuda.blockIdx.x
    e, r0, r1 = _tile_of(tile, tile_expert, tile_first, expert_start)
    if e < 0:
        return
    a_sh = cuda.shared.array((BM, PAD), float32)
    b_sh = cuda.shared.array((BN, PAD), float32)
    tid = cuda.threadIdx.x
    tx = tid & 15
    ty = tid >> 4
    active = r0 + ty < r1  # as in the gate_up kernel
    inter = h_sorted.shape[1]
    H = w2.shape[1]
    n0 = cuda.blockIdx.y * BN
    ar = tid >> 3
    ac = (tid & 7) * VEC
    arow = r0 + ar
    c00 = float32(0.0)
    c01 = float32(0.0)
    c02 = float32(0.0)
    c03 = float32(0.0)
    c10 = float32(0.0)
    c11 = float32(0.0)
    c12 = float32(0.0)
    c13 = float32(0.0)
    kb = 0
    while kb < inter:
        col = kb + ac
        if arow < r1 and col < inter:
            _st8_shared(a_sh, ar, ac, ld8(h_sorted, (arow, col)))
        else:
            _st8_shared(a_sh, ar, ac, ZERO8)
        for i in range(BN * BK // VEC // THREADS):
            q = tid + i * THREADS
            br = q >> 3
            bc = (q & 7) * VEC
            n = n0 + br
            if n < H and kb + bc < inter:
                _st8_shared(b_sh, br, bc, ld8(w2, (e, n, kb + bc)))
            else:
                _st8_shared(b_sh, br, bc, ZERO8)
        cuda.syncthreads()
        for kk in range(BK if active else 0):
            a0 = a_sh[ty, kk]
            a1 = a_sh[ty + 8, kk]
            b0 = b_sh[tx, kk]
            b1 = b_sh[tx + 16, kk]
            b2 = b_sh[tx + 32, kk]
            b3 = b_sh[tx + 48, kk]
            c00 += a0 * b0
            c01 += a0 * b1
            c02 += a0 * b2
            c03 += a0 * b3
            c10 += a1 * b0
            c11 += a1 * b1
            c12 += a1 * b2
            c13 += a1 * b3
        cuda.syncthreads()
        kb += BK
    # Epilogue: the pair's routing weight, into the pair's own row (no atomics).
    s0 = r0 + ty
    s1 = s0 + 8
    if s0 < r1:
        p = order[s0]
        wt = wts_flat[p]
        _st_row4(y_pairs, p, n0 + tx, H, wt, c00, c01, c02, c03)
    if s1 < r1:
        p = order[s1]
        wt = wts_flat[p]
        _st_row4(y_pairs, p, n0 + tx, H, wt, c10, c11, c12, c13)


@cuda.jit(device=True, inline="always")
def _st_row4(y, p, n, H, wt, v0, v1, v2, v3):
    if n < H:
        y[p, n] = wt * v0
    if n + 16 < H:
        y[p, n + 16] = wt * v1
    if n + 32 < H:
        y[p, n + 32] = wt * v2
    if n + 48 < H:
        y[p, n + 48] = wt * v3


def moe_grouped(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32, contiguous
    topk_ids: torch.Tensor,  # [T, k] int32, contiguous
) -> torch.Tensor:
    """Align, the two grouped launches and the slot reduction, all on torch's current stream."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w2.shape[0], w2.shape[2]
    P = T * k
    order, expert_start, tile_first, tile_expert = moe_align_ref(topk_ids, E, BM)
    tiles = tile_expert.shape[0]
    h_sorted = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    y_pairs = torch.empty((P, H), dtype=torch.float32, device=x.device)
    stream = current_stream()
    meta = (order, expert_start, tile_first, tile_expert)
    launch(
        moe_grouped_gate_up_kernel,
        (tiles, (inter + BN_PAIRS - 1) // BN_PAIRS),
        THREADS,
        (x, w13, *meta, k, h_sorted),
        stream,
    )
    launch(
        moe_grouped_down_kernel,
        (tiles, (H + BN - 1) // BN),
        THREADS,
        (h_sorted, w2, *meta, topk_weights.reshape(-1), y_pairs),
        stream,
    )
    return y_pairs.view(T, k, H).sum(dim=1).to(x.dtype)


__all__ = ["moe_grouped", "moe_grouped_gate_up_kernel", "moe_grouped_down_kernel", "BM", "BN"]
