"""Group-quantized linear weights: the one packed form every quantized checkpoint format
(AWQ, GPTQ, compressed-tensors, GGUF) is converted to at load, and its torch reference.

Meaning. For output row n and input column k, with g = group_size:

    w[n, k] = codes[n, k] * scales[n, k // g] + offsets[n, k // g]

codes are unsigned integers below 2**bits (bits 4 or 8). The offset form covers every format
with one fused multiply-add per weight: zero points (offset = -z * s: AWQ, GPTQ, asymmetric
compressed-tensors), block minimums (offset = -dmin * m: GGUF Q4_1, Q4_K, Q5_K), symmetric
formats (offset = -8 * s, -128 * s, or 0). An optional input permutation `perm` [K] (GPTQ
act-order, with K sorted by group at load) means the product is y = x[:, perm] @ w^T.

Layout (`GroupQuantWeight`), chosen for the kernels:

- `qweight` int32 [N, ceil(K / P)], P = 32 // bits codes per 32-bit word, K-contiguous per row
  (a row is one stream: the decode GEMV reads it with 16-byte loads, 32 int4 / 16 int8 codes).
  Inside a word the codes are *pair-interleaved*: code e = 2i + h of the word sits at bit
  16 * h + bits * i, i.e. even codes in the low half-word, odd codes in the high one. So
  (word >> (bits * i)) & 0x000F000F (int4) or & 0x00FF00FF (int8) puts codes 2i and 2i + 1 in
  the two 16-bit halves at once (the fp16x2 "magic number" dequantisation needs exactly that),
  and a single code is one shift and one mask either way.
- `scales`, `offsets` [N, K // g] in the run dtype (fp16 on CUDA, fp32 on CPU): row-major, so
  the GEMV warp that streams row n reads its row's scales contiguously; a GEMM tile reads one
  (scale, offset) per row per group, a few hundred bytes per tile.
- `group_shift`: log2(g) for a power-of-two g; for g = K (per-channel) that is not a power of
  two, 30 (k >> 30 is 0 for every k < 2**30). Kernels find a code's group with one shift.
- `perm`: int64 [K] or None.

Merged projections (qkv, gate_up): `concat_rows` stacks packed weights along N (rows are packed
independently, so this is a cat of qweight / scales / offsets); the weights must agree on bits,
group size, K and perm. Equivalently a loader may concatenate codes/scales/offsets along N and
pack once. `narrow_rows` takes a slice of rows (a shard).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BITS = (4, 8)
# Group sizes the kernels serve: powers of two from 16 up (a 16-byte chunk of int4 codes spans at
# most two groups), or the whole row (g = K, per-channel).
MIN_GROUP = 16
PER_CHANNEL_SHIFT = 30


def codes_per_word(bits: int) -> int:
    return 32 // bits


@dataclass
class GroupQuantWeight:
    """A packed group-quantized weight [N, K] (see the module docstring for the layout)."""

    bits: int
    group_size: int
    in_features: int  # K
    out_features: int  # N
    qweight: torch.Tensor  # int32 [N, ceil(K / (32 // bits))], pair-interleaved codes
    scales: torch.Tensor  # [N, K // group_size], run dtype
    offsets: torch.Tensor  # [N, K // group_size], run dtype
    group_shift: int  # k >> group_shift is k's group
    perm: torch.Tensor | None = None  # int64 [K]: y = x[:, perm] @ w^T

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes the weight occupies on its device (codes, scales, offsets, perm)."""
        ts = [self.qweight, self.scales, self.offsets]
        if self.perm is not None:
            ts.append(self.perm)
        return sum(t.numel() * t.element_size() for t in ts)

    def to(self, device: torch.device | str) -> GroupQuantWeight:
        """The same weight on another device (contiguous, 16-byte aligned fresh allocations)."""
        return replace(
            self,
            qweight=self.qweight.to(device).contiguous(),
            scales=self.scales.to(device).contiguous(),
            offsets=self.offsets.to(device).contiguous(),
            perm=None if self.perm is None else self.perm.to(device).contiguous(),
        )


def _check_group(group_size: int, K: int) -> int:
    """The group shift for group_size, or ValueError naming it."""
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {K}")
    if group_size == K and (K & (K - 1) or K < MIN_GROUP):
        return PER_CHANNEL_SHIFT
    if group_size < MIN_GROUP or group_size & (group_size - 1):
        raise ValueError(
            f"group_size {group_size} is not supported (powers of two >= {MIN_GROUP}, or "
            f"in_features {K} for per-channel)"
        )
    return group_size.bit_length() - 1


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] -> int32 words [N, ceil(K / P)] in the pair-interleaved order."""
    N, K = codes.shape
    P = codes_per_word(bits)
    W = -(-K // P)
    c = codes.to(torch.int64)
    if W * P != K:
        c = torch.nn.functional.pad(c, (0, W * P - K))
    c = c.view(N, W, P // 2, 2)  # [..., i, h]: code 2i + h
    i = torch.arange(P // 2, dtype=torch.int64, device=codes.device)
    h = torch.arange(2, dtype=torch.int64, device=codes.device)
    shift = 16 * h[None, :] + bits * i[:, None]  # [i, h]
    words = (c << shift).sum(dim=(-1, -2))  # disjoint bit fields: sum == or
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_codes(qweight: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """The inverse of pack_codes: int32 words [N, W] -> uint8 codes [N, K]."""
    N, W = qweight.shape
    P = codes_per_word(bits)
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    i = torch.arange(P // 2, dtype=torch.int64, device=qweight.device)
    h = torch.arange(2, dtype=torch.int64, device=qweight.device)
    shift = 16 * h[None, :] + bits * i[:, None]  # [i, h]
    c = (words[:, :, None, None] >> shift) & ((1 << bits) - 1)
    return c.reshape(N, W * P)[:, :K].to(torch.uint8)


def pack_group_quant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
) -> GroupQuantWeight:
    """Pack w[n, k] = codes[n, k] * scales[n, k // g] + offsets[n, k // g] for the kernels.

    codes: uint8 [N, K], values < 2**bits; scales / offsets: float [N, K // group_size];
    bits: 4 or 8; group_size: a power of two >= 16 dividing K, or K; dtype: the run dtype
    (scales and offsets are stored in it); perm: optional int64 [K] permutation of the inputs
    (y = x[:, perm] @ w^T). The result lives on codes' device. Bad input raises ValueError
    naming the argument (this runs once, at load, so it may inspect values)."""
    if bits not in BITS:
        raise ValueError(f"bits {bits} is not supported (one of {BITS})")
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(
            f"codes must be a uint8 [N, K] tensor, got {codes.dtype} {tuple(codes.shape)}"
        )
    N, K = codes.shape
    shift = _check_group(group_size, K)
    G = K // group_size
    for name, t in (("scales", scales), ("offsets", offsets)):
        if tuple(t.shape) != (N, G):
            raise ValueError(
                f"{name} must be [{N}, {G}] (N, K // group_size), got {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes hold {int(codes.max())}, not below 2**{bits}")
    if perm is not None:
        if perm.shape != (K,) or perm.dtype != torch.int64:
            raise ValueError(f"perm must be int64 [{K}], got {perm.dtype} {tuple(perm.shape)}")
        if not torch.equal(perm.sort().values.cpu(), torch.arange(K)):
            raise ValueError("perm is not a permutation of range(in_features)")
        perm = perm.to(codes.device).contiguous()
    dev = codes.device
    return GroupQuantWeight(
        bits=bits,
        group_size=group_size,
        in_features=K,
        out_features=N,
        qweight=pack_codes(codes, bits).contiguous(),
        scales=scales.to(device=dev, dtype=dtype).contiguous(),
        offsets=offsets.to(device=dev, dtype=dtype).contiguous(),
        group_shift=shift,
        perm=perm,
    )


def dequantize(w: GroupQuantWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight [N, K] in `dtype` (default: the run dtype): codes * scale + offset computed in
    fp32 from the stored (run-dtype) scales and offsets, rounded once. This is the reference
    every kernel is tested against."""
    codes = unpack_codes(w.qweight, w.bits, w.in_features).to(torch.float32)
    g = w.group_size
    s = w.scales.to(torch.float32).repeat_interleave(g, dim=1)
    o = w.offsets.to(torch.float32).repeat_interleave(g, dim=1)
    return (codes * s + o).to(dtype or w.dtype)


def concat_rows(ws: list[GroupQuantWeight]) -> GroupQuantWeight:
    """Stack packed weights along N (a merged qkv or gate_up from its shards). They must agree on
    bits, group size, in_features, dtype and perm."""
    if not ws:
        raise ValueError("concat_rows needs at least one weight")
    w0 = ws[0]
    for i, w in enumerate(ws[1:], 1):
        for f in ("bits", "group_size", "in_features", "dtype"):
            if getattr(w, f) != getattr(w0, f):
                raise ValueError(
                    f"concat_rows: weight {i} has {f} {getattr(w, f)}, not {getattr(w0, f)}"
                )
        if (w.perm is None) != (w0.perm is None) or (
            w.perm is not None and not torch.equal(w.perm, w0.perm)
        ):
            raise ValueError(f"concat_rows: weight {i} has a different input permutation")
    return replace(
        w0,
        out_features=sum(w.out_features for w in ws),
        qweight=torch.cat([w.qweight for w in ws]).contiguous(),
        scales=torch.cat([w.scales for w in ws]).contiguous(),
        offsets=torch.cat([w.offsets for w in ws]).contiguous(),
    )


def narrow_rows(w: GroupQuantWeight, start: int, length: int) -> GroupQuantWeight:
    """Rows start .. start + length of w (a shard), as a copy."""
    if start < 0 or length < 0 or start + length > w.out_features:
        raise ValueError(f"rows {start}..{start + length} outside [0, {w.out_features})")
    return replace(
        w,
        out_features=length,
        qweight=w.qweight[start : start + length].contiguous(),
        scales=w.scales[start : start + length].contiguous(),
        offsets=w.offsets[start : start + length].contiguous(),
    )


__all__ = [
    "GroupQuantWeight",
    "pack_group_quant",
    "pack_codes",
    "unpack_codes",
    "dequantize",
    "concat_rows",
    "narrow_rows",
]
