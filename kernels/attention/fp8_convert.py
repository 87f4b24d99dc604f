"""fp8 <-> float conversion in software for the numba.cuda kernels (SM70 has no fp8 type or
conversion instruction): plain fp32 arithmetic and integer ops, exact for every input, the same
code under the CUDA simulator. The meaning is attention/fp8.py's (the torch side).

Encoding is arithmetic rather than bit surgery so one function serves fp16 and fp32 inputs and
runs unchanged in the simulator: the exponent comes from at most 15 comparisons with powers of
two (exact), the mantissa from an exact subtraction, then round-to-nearest-even. Decoding is a
256-entry fp32 table per format (`decode_table`), one load per element.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

E4M3_MAX = 448.0


@cuda.jit(device=True, inline="always")
def _rne(t):
    """t >= 0 (small: < 16) rounded to the nearest integer, ties to even."""
    n = int32(t)
    frac = t - float32(n)
    if frac > float32(0.5) or (frac == float32(0.5) and (n & 1) == 1):
        n += 1
    return n


@cuda.jit(device=True, inline="always")
def encode_e5m2(x):
    """fp16 value x (as fp32) -> e5m2 code: the top byte of its fp16 bits, rounded to nearest
    even (overflow past 57344 rounds to inf, as the fp16 byte would)."""
    if x != x:
        return int32(0x7E)
    sign = int32(0x80) if math.copysign(1.0, x) < 0 else int32(0)  # -0.0 keeps its sign
    a = abs(float32(x))
    if a == float32(math.inf):
        return sign | 0x7C
    if a < float32(2.0**-14):  # subnormal: steps of 2^-16
        return sign | _rne(a * float32(2.0**16))
    e = int32(-14)
    p = float32(2.0**-14)
    while e < 16 and a >= p * float32(2.0):
        p *= float32(2.0)
        e += 1
    n = _rne((a / p - float32(1.0)) * float32(4.0))
    if n == 4:
        n = 0
        e += 1
    if e > 15:
        return sign | 0x7C
    return sign | ((e + 15) << 2) | n


@cuda.jit(device=True, inline="always")
def encode_e4m3(x):
    """fp32 value x (already divided by the scale) -> OCP E4M3 "FN" code, saturated to +-448
    (no inf in the format); NaN -> 0x7F."""
    if x != x:
        return int32(0x7F)
    sign = int32(0x80) if math.copysign(1.0, x) < 0 else int32(0)
    a = min(abs(float32(x)), float32(E4M3_MAX))
    if a < float32(2.0**-6):  # subnormal: steps of 2^-9
        return sign | _rne(a * float32(2.0**9))
    e = int32(-6)
    p = float32(2.0**-6)
    while e < 8 and a >= p * float32(2.0):
        p *= float32(2.0)
        e += 1
    n = _rne((a / p - float32(1.0)) * float32(8.0))
    if n == 8:
        n = 0
        e += 1
    code = ((e + 7) << 3) | n
    return sign | min(code, int32(0x7E))


@cuda.jit(device=True, inline="always")
def encode(x, e4m3, scale):
    """The code of x in the cache's format (e4m3: x / scale)."""
    if e4m3:
        return encode_e4m3(float32(x) / scale)
    return encode_e5m2(float32(x))


def decode_table(fmt: str, device=None):
    """[256] fp32 values of the codes of `fmt` (attention/fp8.py's names), for the kernels'
    decoding loads."""
    import torch
    from voltserve.kernels.attention import fp8

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return fp8.dequantize(codes, fmt, 1.0, torch.float32).to(device)
