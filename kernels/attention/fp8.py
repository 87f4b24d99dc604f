"""One-byte KV cache elements (the torch side: the CPU path and the references).

The cache holds torch.uint8 (SM70 has no fp8 type; the CUDA kernels convert in software):
  fp8_e5m2: the top byte of the fp16 value, rounded to nearest even (5 exponent bits, 2
            mantissa bits; inf and NaN kept).
  fp8_e4m3: OCP E4M3 "FN" (4 exponent bits, 3 mantissa bits, max 448, no inf) of value / scale,
            saturated to +-448 so a large value stays large instead of turning NaN; a read
            multiplies by the same scale (per layer, one for K and one for V).
e5m2 takes no scale: its range is fp16's.
"""

from __future__ import annotations

import torch

E5M2, E4M3 = "fp8_e5m2", "fp8_e4m3"
FORMATS = (E5M2, E4M3)
E4M3_MAX = 448.0
_TORCH = {E5M2: torch.float8_e5m2, E4M3: torch.float8_e4m3fn}


def quantize(x: torch.Tensor, fmt: str, scale: float = 1.0) -> torch.Tensor:
    """x (any float dtype) -> uint8 codes of the same shape. e5m2 rounds x's fp16 value (so an
    fp32 run rounds twice, fp32 -> fp16 -> e5m2, exactly as the fp16 CUDA path sees it)."""
    if fmt == E5M2:
        return x.to(torch.float16).to(torch.float8_e5m2).view(torch.uint8)
    if fmt != E4M3:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {FORMATS}")
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(
    codes: torch.Tensor, fmt: str, scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 codes -> values in dtype (times scale for e4m3)."""
    if fmt not in _TORCH:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {FORMATS}")
    y = codes.view(_TORCH[fmt]).float()
    if fmt == E4M3 and scale != 1.0:
        y = y * scale
    return y.to(dtype)
