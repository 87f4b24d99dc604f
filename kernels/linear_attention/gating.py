"""The gates of a Gated DeltaNet head: decay g = -exp(A_log) * softplus(a + dt_bias) (log
space, <= 0) and write strength beta = sigmoid(b), as transformers' Qwen3NextGatedDeltaNet
computes them: g in fp32 (softplus as torch's, linear above 20), beta = b.sigmoid() in b's
dtype, so rounded to the storage dtype. The kernels compute them
in-register from a and b (`gates`), so no [T, Hv] g / beta tensors are written and read back:
at decode that would be two more launches for a few hundred bytes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from numba import cuda, float32
from voltserve.kernels.runtime.numba_common import round_like

SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default


def gates_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [..., Hv]; A_log, dt_bias: [Hv]. Returns (g, beta), fp32, shaped like a."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float()).to(b.dtype).float()


@cuda.jit(device=True, inline="always")
def gates(a, b, a_log, dt_bias, like):
    """(g, beta) in fp32 from one token's a and b of one head (scalars); beta rounded to the
    storage dtype of `like` (b's array)."""
    x = float32(a) + float32(dt_bias)
    sp = x
    if x <= float32(SOFTPLUS_THRESHOLD):
        sp = float32(math.log1p(math.exp(x)))
    g = -float32(math.exp(float32(a_log))) * sp
    beta = round_like(float32(1.0) / (float32(1.0) + float32(math.exp(-float32(b)))), like)
    return g, beta
