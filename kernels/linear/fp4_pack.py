"""FP4 (E2M1) linear weights with a scale per block of inputs: NVFP4 (E4M3 scale per 16 inputs
and an fp32 global scale per tensor) and MXFP4 (E8M0 scale per 32 inputs), the one packed form
compressed-tensors and ModelOpt checkpoints are converted to at load, and its torch reference.

Meaning. For output row n and input column k, with g the block size:

    w[n, k] = e2m1(code[n, k]) * (scale(scales[n, k // g]) * gscale[n])

computed in fp32 in that order (the block's scale first, then the product with the value).

- code: 4 bits, sign in bit 3, magnitude index in bits 0-2 for the E2M1 values
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent bits 1-2 with bias 1, mantissa bit 0; exponent 0 is
  the subnormal 0 / 0.5). Two codes a byte: input 2j in the low nibble, 2j + 1 in the high
  one (compressed-tensors' pack_fp4_to_uint8; ModelOpt stores the same bytes).
- scale: one byte per block, E4M3 (`E4M3`, float8_e4m3fn: sign, 4 exponent bits with bias 7,
  3 mantissa bits, exponent 0 subnormal; 0x7F / 0xFF are NaN) or E8M0 (`E8M0`: 2**(b - 127);
  0xFF is NaN). NaN scale bytes are refused at load (`check_scale_bytes`), so the kernels
  decode finite values only.
- gscale: the fp32 multiplier per output row. A merged projection (qkv, gate_up) keeps each
  shard's per-tensor global scale on its rows; MXFP4 has none (1.0). compressed-tensors stores
  the divisor (`weight_global_scale`, w = q * scale / global), ModelOpt the multiplier
  (`weight_scale_2`); the loader turns the former into its fp32 reciprocal, so the product can
  differ from the library's division by one fp32 rounding.

Layout (`Fp4Weight`): `packed` uint8 [N, K / 2] (K-contiguous rows: the decode GEMV streams a
row), `scales` uint8 [N, K / g] (the raw scale bytes, 1 byte per g inputs: 4.5 bits a weight
for NVFP4, 4.25 for MXFP4), `gscale` float32 [N]. Block sizes 16 and 32 (`BLOCKS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3, E8M0 = "e4m3", "e8m0"
SCALE_KINDS = (E4M3, E8M0)
BLOCKS = (16, 32)  # the kernels read 16 codes (8 bytes) per chunk: one block either way
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class Fp4Weight:
    """A packed FP4 weight [N, K] (see the module docstring)."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # uint8 [N, K / group_size]
    gscale: torch.Tensor  # float32 [N]
    group_size: int
    scale_kind: str  # E4M3 or E8M0

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def group_shift(self) -> int:
        return self.group_size.bit_length() - 1

    @property
    def e8m0(self) -> bool:
        return self.scale_kind == E8M0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.gscale))


def make_fp4_weight(
    packed: torch.Tensor,
    scales: torch.Tensor,
    gscale: torch.Tensor,
    group_size: int,
    scale_kind: str,
) -> Fp4Weight:
    """Checks shapes, dtypes and the block size, and returns the contiguous weight."""
    if scale_kind not in SCALE_KINDS:
        raise ValueError(f"FP4 scale kind {scale_kind!r}: one of {SCALE_KINDS}")
    if group_size not in BLOCKS:
        raise ValueError(f"FP4 block size {group_size} is not supported (only {list(BLOCKS)})")
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"FP4 codes and scale bytes must be uint8, got {packed.dtype}, {scales.dtype}"
        )
    N, half = packed.shape
    K = 2 * half
    if K % group_size:
        raise ValueError(f"FP4 block size {group_size} does not divide K={K}")
    if tuple(scales.shape) != (N, K // group_size) or tuple(gscale.shape) != (N,):
        raise ValueError(
            f"FP4 scales {tuple(scales.shape)} / global scales {tuple(gscale.shape)} do not fit "
            f"a [{N}, {K}] weight in blocks of {group_size}"
        )
    return Fp4Weight(
        packed.contiguous(),
        scales.contiguous(),
        gscale.to(torch.float32).contiguous(),
        group_size,
        scale_kind,
    )


def check_scale_bytes(raw: torch.Tensor, kind: str, name: str) -> None:
    """Refuses NaN scale bytes (the kernels decode finite scales only)."""
    nan = (raw & 0x7F) == 0x7F if kind == E4M3 else raw == 0xFF
    if bool(nan.any()):
        raise ValueError(f"{name}: {int(nan.sum())} {kind.upper()} scales are NaN")


def decode_scales(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """Scale bytes -> float32 (E4M3 through torch's float8_e4m3fn, E8M0 as 2**(b - 127))."""
    if kind == E4M3:
        return raw.view(torch.float8_e4m3fn).float()
    return torch.exp2(raw.to(torch.float32) - 127.0)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the 4-bit codes [N, K] (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> float32 values (E2M1_VALUES by arithmetic on the device: no host table to
    copy, so a CUDA graph can hold the reference)."""
    m = (codes & 7).to(torch.float32)
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, 2 * m - 8))
    return torch.where((codes & 8) != 0, -mag, mag)


def block_scales(w: Fp4Weight) -> torch.Tensor:
    """float32 [N, K / g]: each block's scale times its row's global scale."""
    return decode_scales(w.scales, w.scale_kind) * w.gscale[:, None]


def dequantize_fp4(w: Fp4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight, computed in fp32 and rounded once to dtype."""
    vals = e2m1_decode(unpack_codes(w.packed))
    s = block_scales(w).repeat_interleave(w.group_size, dim=1)
    return (vals * s).to(dtype)


def concat_rows(parts: list[Fp4Weight]) -> Fp4Weight:
    """Shards of one merged projection stacked along N (one block size and scale kind)."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.scale_kind != first.scale_kind for p in parts):
        raise ValueError("FP4 shards of a merged linear differ in block size or scale kind")
    return make_fp4_weight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.gscale for p in parts]),
        first.group_size,
        first.scale_kind,
    )
