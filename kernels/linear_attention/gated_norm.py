"""The gated RMSNorm after the gated delta rule: out = rmsnorm(x) * weight * silu(z), per value
head (rows of Dv), as transformers' Qwen3NextRMSNormGated rounds it: the variance in fp32, the
normalised value rounded to the storage dtype before the weight, the gate in fp32, one rounding
at the end (the weight times the normalised value is rounded as torch rounds the product of two
fp16 tensors).

Kernel (CUDA cores, memory bound): one block per row of Dv (128 at the real shapes), one thread
per element (blockDim = Dv rounded up to a warp), the sum of squares by a block reduction.
z may be a strided view (the gate columns of the fused projection).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import (
    block_sum,
    current_stream,
    float32,
    launch,
    round_like,
)

MAX_THREADS = 1024


def gated_rms_norm_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, z: [N, D]; weight [D]. Returns a new [N, D] tensor in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


@cached
@cuda.jit
def gated_rms_norm_kernel(x, z, weight, out, eps):
    row = cuda.blockIdx.x
    c = cuda.threadIdx.x
    D = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    v = float32(0.0)
    if c < D:
        v = float32(x[row, c])
    total = block_sum(v * v, scratch)
    inv = float32(1.0) / math.sqrt(total / float32(D) + eps)
    if c < D:
        n = round_like(float32(weight[c]) * round_like(v * inv, out), out)
        zv = float32(z[row, c])
        out[row, c] = n * (zv / (float32(1.0) + float32(math.exp(-zv))))


def gated_rms_norm_cuda(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same meaning as gated_rms_norm_ref."""
    if not on_gpu(x):
        raise ValueError("gated_rms_norm_cuda needs CUDA tensors")
    N, D = x.shape
    if tuple(z.shape) != (N, D) or tuple(weight.shape) != (D,):
        raise ValueError(
            f"gated_rms_norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}"
        )
    if D > MAX_THREADS:
        raise ValueError(f"gated_rms_norm: rows of {D} exceed {MAX_THREADS}")
    out = torch.empty_like(x)
    stream = current_stream()
    for kernel, grid, block, args in norm_launches(x, z, weight, eps, out):
        launch(kernel, grid, block, args, stream)
    return out


def norm_launches(x, z, weight, eps, out) -> list[tuple]:
    N, D = x.shape
    if N == 0:
        return []
    args = (x, z, weight, out, np.float32(eps))
    return [(gated_rms_norm_kernel, N, (D + 31) // 32 * 32, args)]
