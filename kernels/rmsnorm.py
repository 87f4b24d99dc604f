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
