"""fp8 <-> float conversion in software for the numba.cuda kernels (SM70 has no fp8 type or
conversion instruction): integer ops on the fp32 bit pattern, exact for every input, the same
code under the CUDA simulator. The meaning is attention/fp8.py's (the torch side).

Encoding (`encode_fp8`) works on the fp32 bits, so one function serves fp16 values (exact in
fp32: e5m2 of the fp16 value rounds once) and the fp32 quotient x / scale of e4m3: rebias the
exponent in place, round the dropped mantissa bits to nearest even (a carry moves into the
exponent by itself), shift out further below the format's smallest normal. A format is the tuple
(mantissa bits, exponent bias, largest finite code, code past it, NaN code): e5m2 overflows to
inf, e4m3fn (no inf) saturates at 448. Decoding is a 256-entry fp32 table per format
(`decode_table`), one load per element.
"""

from __future__ import annotations

from numba import cuda, float32, int32
from voltserve.kernels.runtime.numba_common import float_bits

# (mantissa bits, bias, largest finite code, overflow code, NaN code); the exponent bits are
# implied by the codes. e5m2 overflows to inf (0x7C); e4m3fn saturates at 448 (0x7E).
E5M2_FORMAT = (2, 15, 0x7B, 0x7C, 0x7E)
E4M3_FORMAT = (3, 7, 0x7E, 0x7E, 0x7F)


@cuda.jit(device=True, inline="always")
def encode_fp8(x, fmt):
    """fp32 value x -> its code in fmt (a *_FORMAT tuple), rounded to nearest even; NaN -> the
    format's NaN code (no sign), -0.0 keeps its sign."""
    man, bias, max_code, over_code, nan_code = fmt
    b = int32(float_bits(float32(x)))
    sign = (b >> 24) & 0x80
    u = b & 0x7FFFFFFF
    if u > 0x7F800000:
        return int32(nan_code)
    drop = 23 - man  # fp32 mantissa bits below the format's
    e = u >> 23  # fp32 biased exponent
    if e > 127 - bias:  # a normal of the format (or past it): rebias the exponent in place
        code = (u >> drop) - ((127 - bias) << man)
        rest = u & ((1 << drop) - 1)
    else:  # below the smallest normal: the significand with its leading 1, shifted further
        drop += 128 - bias - e
        if drop > 24:  # under half the smallest subnormal (fp32 subnormals included)
            return int32(sign)
        sig = (u & 0x7FFFFF) | 0x800000
        code = sig >> drop
        rest = sig & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    if rest > half or (rest == half and (code & 1) == 1):
        code += 1
    if code > max_code:
        code = over_code
    return int32(sign | code)


@cuda.jit(device=True, inline="always")
def encode(x, e4m3, scale):
    """The code of x in the cache's format (e4m3: x / scale)."""
    if e4m3:
        return encode_fp8(float32(x) / scale, E4M3_FORMAT)
    return encode_fp8(float32(x), E5M2_FORMAT)


def decode_table(fmt: str, device=None):
    """[256] fp32 values of the codes of `fmt` (attention/fp8.py's names), for the kernels'
    decoding loads."""
    import torch
    from voltserve.kernels.attention import fp8

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return fp8.dequantize(codes, fmt, 1.0, torch.float32).to(device)
