"""A K-quant weight (kquant_pack.py) into an [N, K] buffer of the run dtype: the path above the
GEMV's rows (prefill, batched decode), followed by cuBLAS. It writes into the reused scratch of
the quantized formats (quant_linear.QuantScratch, sized at load for the largest quantized linear),
so the weights stay at the file's size and the float copy exists for one linear at a time.

One thread per 64 weights of a row (a ggml block's quarter, the GEMV lane's share: Q4_K qs chunk
c, Q6_K half n and elements 16h .. 16h + 15 of its quarters): its 16-byte loads, then 16-byte
stores of 8 values (vec_io.st8). Each value is ggml's, computed in fp32 (Q4_K d * sc * q - dmin
* m, Q6_K d * sc * (q - 32)) and rounded once to the buffer's dtype. Rows go over y and z
(launch_geometry.fold_yz: vocabularies pass 65,535 rows).
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.linear.kquant_pack import QK_K, KQuantWeight, dequantize_kquant
from voltserve.kernels.linear.quant_common import ld_w4
from voltserve.kernels.runtime.half2 import h2f
from voltserve.kernels.runtime.launch_geometry import fold_yz, on_gpu
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch
from voltserve.kernels.runtime.vec_io import st8

THREADS = 64  # threads a block: K = 4096 is 64 quarters of blocks a row
Q4_WORDS, Q6_WORDS = 36, 48


@cuda.jit(device=True, inline="always")
def _q4_eight(w0, w1, nib, s, o):
    """8 weights from bytes 0..3 of w0 then w1 (the nibble at bit nib of each byte): q * s + o."""
    return (
        float32((w0 >> nib) & 15) * s + o,
        float32((w0 >> (8 + nib)) & 15) * s + o,
        float32((w0 >> (16 + nib)) & 15) * s + o,
        float32((w0 >> (24 + nib)) & 15) * s + o,
        float32((w1 >> nib) & 15) * s + o,
        float32((w1 >> (8 + nib)) & 15) * s + o,
        float32((w1 >> (16 + nib)) & 15) * s + o,
        float32((w1 >> (24 + nib)) & 15) * s + o,
    )


@cuda.jit(device=True, inline="always")
def _q6(wl, wh, e, nib, hs):
    """The 6-bit code of byte e: ql nibble at bit nib, qh bits at hs."""
    return (((wl >> (8 * e + nib)) & 15) | (((wh >> (8 * e + hs)) & 3) << 4)) - 32


@cuda.jit(device=True, inline="always")
def _q6_eight(l0, l1, h0, h1, nib, hs, s):
    return (
        float32(_q6(l0, h0, 0, nib, hs)) * s,
        float32(_q6(l0, h0, 1, nib, hs)) * s,
        float32(_q6(l0, h0, 2, nib, hs)) * s,
        float32(_q6(l0, h0, 3, nib, hs)) * s,
        float32(_q6(l1, h1, 0, nib, hs)) * s,
        float32(_q6(l1, h1, 1, nib, hs)) * s,
        float32(_q6(l1, h1, 2, nib, hs)) * s,
        float32(_q6(l1, h1, 3, nib, hs)) * s,
    )


@cuda.jit
def dequant_q4_k_kernel(qw, out):
    row = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y  # launch_geometry.fold_yz
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= out.shape[0] or t >= (out.shape[1] // QK_K) * 4:
        return
    b = t >> 2
    c = t & 3
    wb = b * Q4_WORDS
    h = ld_w4(qw, (row, wb))
    p = ld_w4(qw, (row, wb + 4 + 8 * c))
    q = ld_w4(qw, (row, wb + 8 + 8 * c))
    d, dmin = h2f(h[0])
    if c < 2:
        sw = h[1] & 0x3F3F3F3F
        mw = h[2] & 0x3F3F3F3F
    else:
        sw = (h[3] & 0x0F0F0F0F) | ((h[1] >> 2) & 0x30303030)
        mw = ((h[3] >> 4) & 0x0F0F0F0F) | ((h[2] >> 2) & 0x30303030)
    sh = (c & 1) * 16
    sa = d * float32((sw >> sh) & 63)
    oa = -(dmin * float32((mw >> sh) & 63))
    sb = d * float32((sw >> (sh + 8)) & 63)
    ob = -(dmin * float32((mw >> (sh + 8)) & 63))
    col = b * QK_K + c * 64
    st8(out, (row, col), _q4_eight(p[0], p[1], 0, sa, oa))
    st8(out, (row, col + 8), _q4_eight(p[2], p[3], 0, sa, oa))
    st8(out, (row, col + 16), _q4_eight(q[0], q[1], 0, sa, oa))
    st8(out, (row, col + 24), _q4_eight(q[2], q[3], 0, sa, oa))
    st8(out, (row, col + 32), _q4_eight(p[0], p[1], 4, sb, ob))
    st8(out, (row, col + 40), _q4_eight(p[2], p[3], 4, sb, ob))
    st8(out, (row, col + 48), _q4_eight(q[0], q[1], 4, sb, ob))
    st8(out, (row, col + 56), _q4_eight(q[2], q[3], 4, sb, ob))


@cuda.jit
def dequant_q6_k_kernel(qw, scales, dd, out):
    row = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= out.shape[0] or t >= (out.shape[1] // QK_K) * 4:
        return
    b = t >> 2
    hn = (t >> 1) & 1
    hl = t & 1
    wb = b * Q6_WORDS
    w1 = wb + 16 * hn + 4 * hl
    a = ld_w4(qw, (row, w1))  # ql[64n + 16h ..]: quarters 0 (low nibbles) and 2 (high)
    e = ld_w4(qw, (row, w1 + 8))  # ql[64n + 32 + 16h ..]: quarters 1 and 3
    g = ld_w4(qw, (row, wb + 32 + 8 * hn + 4 * hl))  # qh[32n + 16h ..]: bits 2j of quarter j
    d = float32(dd[row, b])
    sb = b * 16 + 8 * hn + hl
    s0 = d * float32(scales[row, sb])
    s1 = d * float32(scales[row, sb + 2])
    s2 = d * float32(scales[row, sb + 4])
    s3 = d * float32(scales[row, sb + 6])
    col = b * QK_K + hn * 128 + hl * 16
    st8(out, (row, col), _q6_eight(a[0], a[1], g[0], g[1], 0, 0, s0))
    st8(out, (row, col + 8), _q6_eight(a[2], a[3], g[2], g[3], 0, 0, s0))
    st8(out, (row, col + 32), _q6_eight(e[0], e[1], g[0], g[1], 0, 2, s1))
    st8(out, (row, col + 40), _q6_eight(e[2], e[3], g[2], g[3], 0, 2, s1))
    st8(out, (row, col + 64), _q6_eight(a[0], a[1], g[0], g[1], 4, 4, s2))
    st8(out, (row, col + 72), _q6_eight(a[2], a[3], g[2], g[3], 4, 4, s2))
    st8(out, (row, col + 96), _q6_eight(e[0], e[1], g[0], g[1], 4, 6, s3))
    st8(out, (row, col + 104), _q6_eight(e[2], e[3], g[2], g[3], 4, 6, s3))


def grid_for(w: KQuantWeight, limit: int | None = None) -> tuple[int, int, int]:
    per_row = -(-(w.nblocks * 4) // THREADS)
    yz = fold_yz(w.out_features) if limit is None else fold_yz(w.out_features, limit)
    return (per_row, *yz)


def supports(w: KQuantWeight, out: torch.Tensor) -> bool:
    return (
        w.kind in ("Q4_K", "Q6_K")
        and on_gpu(w.blocks)
        and on_gpu(out)
        and out.dtype in (torch.float16, torch.float32)
        and tuple(out.shape) == w.shape
        and out.is_contiguous()
        and out.data_ptr() % 16 == 0
        and w.blocks.is_contiguous()
        and w.blocks.data_ptr() % 16 == 0
        and w.blocks.stride(0) % 16 == 0
    )


def dequantize_into(w: KQuantWeight, out: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """out[:] = dequantize_kquant(w) in out's dtype (the reference where `supports` says no)."""
    if not supports(w, out):
        return out.copy_(dequantize_kquant(w, out.dtype))
    if w.kind == "Q4_K":
        kernel, args = dequant_q4_k_kernel, (w.words(), out)
    else:
        kernel, args = dequant_q6_k_kernel, (w.words(), w.scales, w.d, out)
    launch(kernel, grid_for(w, limit), THREADS, args, current_stream())
    return out


__all__ = ["dequant_q4_k_kernel", "dequant_q6_k_kernel", "dequantize_into", "grid_for", "supports"]
