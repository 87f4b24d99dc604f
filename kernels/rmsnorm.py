"""RMSNorm and RMSNorm fused with the residual add.

Rounding follows transformers' LlamaRMSNorm so fp16 outputs match it: the variance is taken in
fp32, the normalised value is cast back to the storage dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; returns a new [T, H] tensor in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual <- x + residual (in storage dtype); x <- rms_norm(residual) * weight."""
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels: one block per row. Each thread keeps its first VPT values in registers so
# the second pass (normalise) does not re-read memory for rows up to VPT * blockDim wide; wider
# rows re-read the tail (an L2 hit). Loads are coalesced scalar loads, VPT of them in flight.

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.numba_common import (  # noqa: E402
    block_for,
    block_sum,
    current_stream,
    dev,
    float32,
    launch,
    round_like,
)

VPT = 8


@cuda.jit
def rms_norm_kernel(x, weight, out, eps):
    row = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    vals = cuda.local.array(VPT, float32)
    ss = float32(0.0)
    for j in range(VPT):
        i = tid + j * bd
        v = float32(0.0)
        if i < hidden:
            v = float32(x[row, i])
        vals[j] = v
        ss += v * v
    i = tid + VPT * bd
    while i < hidden:
        v = float32(x[row, i])
        ss += v * v
        i += bd
    total = block_sum(ss, scratch)
    inv = float32(float32(1.0) / float32(math.sqrt(float32(total / float32(hidden)) + eps)))
    for j in range(VPT):
        i = tid + j * bd
        if i < hidden:
            out[row, i] = float32(weight[i]) * round_like(vals[j] * inv, out)
    i = tid + VPT * bd
    while i < hidden:
        out[row, i] = float32(weight[i]) * round_like(float32(x[row, i]) * inv, out)
        i += bd


@cuda.jit
def fused_add_rms_norm_kernel(x, residual, weight, eps):
    row = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    vals = cuda.local.array(VPT, float32)
    ss = float32(0.0)
    for j in range(VPT):
        i = tid + j * bd
        r = float32(0.0)
        if i < hidden:
            r = round_like(float32(residual[row, i]) + float32(x[row, i]), residual)
            residual[row, i] = r
        vals[j] = r
        ss += r * r
    i = tid + VPT * bd
    while i < hidden:
        r = round_like(float32(residual[row, i]) + float32(x[row, i]), residual)
        residual[row, i] = r
        ss += r * r
        i += bd
    total = block_sum(ss, scratch)
    inv = float32(float32(1.0) / float32(math.sqrt(float32(total / float32(hidden)) + eps)))
    for j in range(VPT):
        i = tid + j * bd
        if i < hidden:
            x[row, i] = float32(weight[i]) * round_like(vals[j] * inv, x)
    i = tid + VPT * bd
    while i < hidden:
        # This thread wrote residual[row, i] above, so reading it back is ordered.
        x[row, i] = float32(weight[i]) * round_like(float32(residual[row, i]) * inv, x)
        i += bd


def _block(hidden: int) -> int:
    return block_for(hidden, VPT)


def rms_norm_cuda(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same meaning as rms_norm_ref. x: [T, H] with unit stride along H."""
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0]:
        launch(
            rms_norm_kernel,
            x.shape[0],
            _block(x.shape[1]),
            (dev(x), dev(weight), dev(out), float(eps)),
            current_stream(),
        )
    return out


def fused_add_rms_norm_cuda(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Same meaning as fused_add_rms_norm_ref (in place on x and residual)."""
    if x.shape[0]:
        launch(
            fused_add_rms_norm_kernel,
            x.shape[0],
            _block(x.shape[1]),
            (dev(x), dev(residual), dev(weight), float(eps)),
            current_stream(),
        )
