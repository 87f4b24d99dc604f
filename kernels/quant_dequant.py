"""A group-quantized weight dequantized into a given [N, K] buffer (the prefill path's scratch).
First version: the torch reference; the numba kernel lands next."""

from __future__ import annotations

import torch
from voltserve.kernels.quant_pack import GroupQuantWeight, dequantize


def dequantize_into(w: GroupQuantWeight, out: torch.Tensor) -> torch.Tensor:
    out.copy_(dequantize(w, out.dtype))
    return out
