"""Fused MoE experts for decode-sized batches (T <= 8 tokens): per token, only its k experts'
weights are read, in two launches and no host synchronisation.

1. gate_up: h[p, j] = silu(x[t] . w13[e, j]) * (x[t] . w13[e, I + j]) for every pair p = t * k
   + slot (e = topk_ids[t, slot]). One warp owns one (pair, j): the gate row and the up row of
   the same expert, so both sums end in the same warp. Each lane reads 16 bytes of each row per
   chunk, U chunks per step, all 2 * U loads of a step issued before the first multiply (the
   weight-streaming layout of kernels/linear/gemv.py); x is re-read next to its use (L1/L2 hits).
   Rounding as the linear and the activation round: gate and up to the storage dtype, silu
   rounded before the product.
2. down + weighted sum: out[t, n] = sum_slot w[t, slot] * (h[t * k + slot] . w2[e_slot, n]).
   One block owns (t, n) and (t, n + 1); its warps split the k experts' rows of w2, one flat
   list of 16-byte chunks (k * I / 8 per row), 4 chunks of both rows (8 loads) per lane in
   flight, and add their sums in warp order; each h chunk serves both rows, which halves the
   L1/L2 traffic for h. The weighted sum is in fp32
   and the output is rounded once. No atomics, no [T, k, H] intermediate.

Both read every selected expert's weights exactly once per token (the decode floor); tokens that
share an expert re-read it, which L2 absorbs at these T.

The reference is kernels/moe/experts.py's moe_experts_ref (meaning and rounding).
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.linear.gemv import _warp_sum
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.numba_common import SIM, current_stream, float32, launch, round_like
from voltserve.kernels.runtime.vec_io import VEC, dot8, ld8

MAX_TOKENS = 8
# Warps per block. The simulator's shuffle is exact only within a one-warp block.
WARPS = 1 if SIM else 4
U = 4  # gate_up: chunks per lane per step (x 2 rows = 8 loads of 16 bytes in flight)
WARP_ELEMS = 32 * VEC  # elements a warp reads per chunk of one row


@cached
@cuda.jit
def moe_decode_gate_up_kernel(x, w13, topk_ids, h):
    # x [T, H], w13 [E, 2I, H], topk_ids [T, k] int32, h [T * k, I]
    lane = cuda.threadIdx.x & 31
    j = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5
    p = cuda.blockIdx.y
    inter = h.shape[1]
    if j >= inter:
        return  # the whole warp leaves together: the shuffles stay full-mask
    k = topk_ids.shape[1]
    t = p // k
    e = topk_ids[t, p - t * k]
    ju = inter + j
    H = x.shape[1]
    a = float32(0.0)
    b = float32(0.0)
    c = lane * VEC
    k0 = 0
    while k0 + U * WARP_ELEMS <= H:
        c0 = k0 + c
        c1 = c0 + WARP_ELEMS
        c2 = c1 + WARP_ELEMS
        c3 = c2 + WARP_ELEMS
        g0 = ld8(w13, (e, j, c0))
        g1 = ld8(w13, (e, j, c1))
        g2 = ld8(w13, (e, j, c2))
        g3 = ld8(w13, (e, j, c3))
        u0 = ld8(w13, (e, ju, c0))
        u1 = ld8(w13, (e, ju, c1))
        u2 = ld8(w13, (e, ju, c2))
        u3 = ld8(w13, (e, ju, c3))
        xv = ld8(x, (t, c0))
        a = dot8(a, xv, g0)
        b = dot8(b, xv, u0)
        xv = ld8(x, (t, c1))
        a = dot8(a, xv, g1)
        b = dot8(b, xv, u1)
        xv = ld8(x, (t, c2))
        a = dot8(a, xv, g2)
        b = dot8(b, xv, u2)
        xv = ld8(x, (t, c3))
        a = dot8(a, xv, g3)
        b = dot8(b, xv, u3)
        k0 += U * WARP_ELEMS
    while k0 < H:  # the tail, one chunk per lane at a time (H is a multiple of 8)
        c0 = k0 + c
        if c0 < H:
            xv = ld8(x, (t, c0))
            a = dot8(a, xv, ld8(w13, (e, j, c0)))
            b = dot8(b, xv, ld8(w13, (e, ju, c0)))
        k0 += WARP_ELEMS
    a = _warp_sum(a)
    b = _warp_sum(b)
    if lane == 0:
        h[p, j] = _silu_mul(round_like(a, h), round_like(b, h), h)


@cuda.jit(device=True, inline="always")
def _w2_chunk2(w2, topk_ids, t, n, q, ic):
    """Flat chunk q of token t's k slots: (slot, column, w2[e, n, col:+8], w2[e, n + 1, col:+8])."""
    s = q // ic
    col = (q - s * ic) * VEC
    e = topk_ids[t, s]
    return s, col, ld8(w2, (e, n, col)), ld8(w2, (e, n + 1, col))


@cuda.jit(device=True, inline="always")
def _wdot2(a, b, h, wts, t, k, s, col, v0, v1):
    """(a, b) + w[t, s] * (h[t * k + s, col:col+8] . (v0, v1)): one h chunk serves both rows."""
    hv = ld8(h, (t * k + s, col))
    w = wts[t, s]
    return a + w * dot8(float32(0.0), hv, v0), b + w * dot8(float32(0.0), hv, v1)


@cached
@cuda.jit
def moe_decode_down_kernel(h, w2, topk_ids, wts, out):
    # h [T * k, I], w2 [E, H, I], topk_ids [T, k] int32, wts [T, k] fp32, out [T, H]; one block
    # owns rows n and n + 1 (H is even), so each h chunk it reads serves two weight rows, and
    # its WARPS warps split the k experts' chunks of those rows between them: at one token a
    # warp per row pair gave ~8 warps per SM (H / 2 = 1024 warps on 132 SMs), too few loads in
    # flight to stream w2 (13.7 us against a 5.9 us floor for Qwen3-30B-A3B on an H200).
    lane = cuda.threadIdx.x & 31
    warp = cuda.threadIdx.x >> 5
    n = cuda.blockIdx.x * 2
    t = cuda.blockIdx.y
    if n >= out.shape[1]:
        return  # the whole block
    k = topk_ids.shape[1]
    ic = h.shape[1] // VEC
    total = k * ic
    a = float32(0.0)
    b = float32(0.0)
    S = 32 * WARPS  # chunks the block takes per pass
    q = warp * 32 + lane
    # 4 chunks x 2 rows = 8 loads of 16 bytes per lane in flight, all before the first use.
    while q + 3 * S < total:
        s0, o0, v0, u0 = _w2_chunk2(w2, topk_ids, t, n, q, ic)
        s1, o1, v1, u1 = _w2_chunk2(w2, topk_ids, t, n, q + S, ic)
        s2, o2, v2, u2 = _w2_chunk2(w2, topk_ids, t, n, q + 2 * S, ic)
        s3, o3, v3, u3 = _w2_chunk2(w2, topk_ids, t, n, q + 3 * S, ic)
        a, b = _wdot2(a, b, h, wts, t, k, s0, o0, v0, u0)
        a, b = _wdot2(a, b, h, wts, t, k, s1, o1, v1, u1)
        a, b = _wdot2(a, b, h, wts, t, k, s2, o2, v2, u2)
        a, b = _wdot2(a, b, h, wts, t, k, s3, o3, v3, u3)
        q += 4 * S
    while q < total:
        s0, o0, v0, u0 = _w2_chunk2(w2, topk_ids, t, n, q, ic)
        a, b = _wdot2(a, b, h, wts, t, k, s0, o0, v0, u0)
        q += S
    a = _warp_sum(a)
    b = _warp_sum(b)
    # The warps' sums in warp order (fixed: the result does not depend on scheduling).
    sa = cuda.shared.array(WARPS, float32)
    sb = cuda.shared.array(WARPS, float32)
    if lane == 0:
        sa[warp] = a
        sb[warp] = b
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        ta = sa[0]
        tb = sb[0]
        for w in range(1, WARPS):
            ta += sa[w]
            tb += sb[w]
        out[t, n] = ta
        out[t, n + 1] = tb


def gate_up_grid(num_pairs: int, inter: int) -> tuple[int, int]:
    return (inter + WARPS - 1) // WARPS, num_pairs


def down_grid(tokens: int, hidden: int) -> tuple[int, int]:
    return hidden // 2, tokens  # row pairs, one per block


def moe_decode(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32, contiguous
    topk_ids: torch.Tensor,  # [T, k] int32, contiguous
) -> torch.Tensor:
    """The two launches on torch's current stream, for inputs moe_experts.supports accepted."""
    T, H = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[2]
    h = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    stream = current_stream()
    ids = topk_ids
    launch(
        moe_decode_gate_up_kernel,
        gate_up_grid(T * k, inter),
        32 * WARPS,
        (x, w13, ids, h),
        stream,
    )
    launch(
        moe_decode_down_kernel,
        down_grid(T, H),
        32 * WARPS,
        (h, w2, ids, topk_weights, out),
        stream,
    )
    return out


__all__ = ["moe_decode", "moe_decode_gate_up_kernel", "moe_decode_down_kernel", "MAX_TOKENS"]
