"""How the one-byte (and fp16) KV caches round K and V, written for the tests from torch's own
float8 casts, independent of the code under test (kernels/attention/fp8.py, fp8_convert.py)."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def codes(x: torch.Tensor, fmt: str, scale: float = 1.0) -> torch.Tensor:
    """uint8 codes of x: e5m2 from its fp16 value; e4m3 of x / scale, saturated at +-448."""
    if fmt == "fp8_e5m2":
        return x.to(torch.float16).to(torch.float8_e5m2).view(torch.uint8)
    assert fmt in ("fp8", "fp8_e4m3"), fmt
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def from_codes(c: torch.Tensor, fmt: str, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values of uint8 codes c (codes' inverse), in dtype."""
    if fmt == "fp8_e5m2":
        return c.view(torch.float8_e5m2).to(dtype)
    return (c.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def rounded(x: torch.Tensor, kv_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """x as the cache gives it back, in x's dtype."""
    if kv_dtype == "fp16":
        return x.to(torch.float16).to(x.dtype)
    return from_codes(codes(x, kv_dtype, scale), kv_dtype, scale, x.dtype)
