"""A group-quantized weight dequantized into a given [N, K] buffer of the run dtype: the prefill
path (quant_linear.py) writes one layer into a reused scratch buffer and hands it to cuBLAS.
Reference: `dequantize` (quant_pack.py), codes * scale + offset in fp32, rounded once.

One thread per 16 bytes of codes (4 words: 32 int4 / 16 int8 codes), grid (blocks along a row,
rows): the rows fold over gridDim.y and .z past gridDim.y's 65,535 (launch_geometry.fold_yz; a
Q6_K / Q8_0 lm_head has a vocabulary's rows, up to 262,144). A thread does a 16-byte load,
exact float codes (c is an integer below 256, so float32(c) is exact), one multiply-add per
code, and 16-byte stores of 8 outputs (vec_io.st8). K must be a multiple of 32 (int4) / 16
(int8) and out 16-byte aligned rows (`supports`); otherwise the torch reference.
The kernel is write-bound (2 bytes out per code): ~ (N * K * (2 + bits / 8)) / bandwidth.
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.linear.quant_common import ld_w4
from voltserve.kernels.linear.quant_pack import GroupQuantWeight, dequantize
from voltserve.kernels.runtime.launch_geometry import MAX_GRID_YZ, fold_yz, on_gpu
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch, named_kernel
from voltserve.kernels.runtime.vec_io import st8

THREADS = 128


def _make(bits: int):
    P = 32 // bits
    MASK = (1 << bits) - 1

    @cuda.jit(device=True, inline="always")
    def code(u, e):
        # Code e of a word in the pair-interleaved order (quant_pack.py): bit 16 (e & 1) + bits (e >> 1).
        return float32((u >> ((e & 1) * 16 + (e >> 1) * bits)) & MASK)

    def kernel(qw, scales, offsets, out, gshift):
        row = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y  # launch_geometry.fold_yz
        c = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * 4  # first word
        W = qw.shape[1]
        if c >= W or row >= qw.shape[0]:
            return
        G = scales.shape[1]
        u = ld_w4(qw, (row, c))
        if P == 8:
            for q in range(4):
                g = min(((c + q) * P) >> gshift, G - 1)
                s = float32(scales[row, g])
                o = float32(offsets[row, g])
                w = u[q]
                st8(
                    out,
                    (row, (c + q) * P),
                    (
                        code(w, 0) * s + o,
                        code(w, 1) * s + o,
                        code(w, 2) * s + o,
                        code(w, 3) * s + o,
                        code(w, 4) * s + o,
                        code(w, 5) * s + o,
                        code(w, 6) * s + o,
                        code(w, 7) * s + o,
                    ),
                )
        else:
            for t in range(2):  # two words (8 int8 codes) per store; one group (g >= 16)
                g = min(((c + 2 * t) * P) >> gshift, G - 1)
                s = float32(scales[row, g])
                o = float32(offsets[row, g])
                w0 = u[2 * t]
                w1 = u[2 * t + 1]
                st8(
                    out,
                    (row, (c + 2 * t) * P),
                    (
                        code(w0, 0) * s + o,
                        code(w0, 1) * s + o,
                        code(w0, 2) * s + o,
                        code(w0, 3) * s + o,
                        code(w1, 0) * s + o,
                        code(w1, 1) * s + o,
                        code(w1, 2) * s + o,
                        code(w1, 3) * s + o,
                    ),
                )

    return cuda.jit(named_kernel(kernel, __name__, f"dequant_int{bits}_kernel"))


dequant_int4_kernel = _make(4)
dequant_int8_kernel = _make(8)
_KERNELS = {4: dequant_int4_kernel, 8: dequant_int8_kernel}


def grid_for(w: GroupQuantWeight, limit: int = MAX_GRID_YZ) -> tuple[int, int, int]:
    """(blocks along a row, then the rows folded over y and z): one row of blocks per weight
    row, y holding up to `limit` of them (the CUDA grid's; tests lower it to fold small
    shapes)."""
    chunks = -(-w.qweight.shape[1] // 4)
    return (-(-chunks // THREADS), *fold_yz(w.out_features, limit))


def supports(w: GroupQuantWeight, out: torch.Tensor) -> bool:
    P = 32 // w.bits
    return (
        on_gpu(out)
        and on_gpu(w.qweight)
        and out.dtype in (torch.float16, torch.float32)
        and out.dtype == w.scales.dtype
        and tuple(out.shape) == w.shape
        and out.is_contiguous()
        and out.data_ptr() % 16 == 0
        and w.qweight.data_ptr() % 16 == 0
        and w.in_features % (4 * P) == 0
    )


def dequantize_into(w: GroupQuantWeight, out: torch.Tensor) -> torch.Tensor:
    """out[:] = dequantize(w) (out [N, K] of the run dtype). No host sync: graph-capturable."""
    if not supports(w, out):
        out.copy_(dequantize(w, out.dtype))
        return out
    launch(
        _KERNELS[w.bits],
        grid_for(w),
        THREADS,
        (w.qweight, w.scales, w.offsets, out, w.group_shift),
        current_stream(),
    )
    return out


__all__ = ["dequantize_into", "supports", "grid_for", "dequant_int4_kernel", "dequant_int8_kernel"]
