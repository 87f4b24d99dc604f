"""SiLU-and-multiply, the gated MLP activation: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up, as the merged gate_up projection produces); returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
