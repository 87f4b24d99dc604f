"""GGUF (ggml) block types unpacked into codes + float32 scales/offsets, from the block layouts
of ggml-common.h and the dequantize_row_* rules of ggml-quants.c:

| type | elems/bytes | codes | group | w = codes * scale + offset |
|---|---|---|---|---|
| Q4_0 | 32 / 18 | 4-bit | 32 | d * (q - 8) |
| Q4_1 | 32 / 20 | 4-bit | 32 | d * q + m |
| Q5_0 | 32 / 22 | 5-bit (8-bit storage) | 32 | d * (q - 16) |
| Q5_1 | 32 / 24 | 5-bit (8-bit storage) | 32 | d * q + m |
| Q8_0 | 32 / 34 | int8 + 128 | 32 | d * (q - 128) |
| Q2_K | 256 / 84 | 2-bit (4-bit storage) | 16 | d*sc * q - dmin*m |
| Q3_K | 256 / 110 | 3-bit (4-bit storage) | 16 | d*(sc-32) * (q - 4) |
| Q4_K | 256 / 144 | 4-bit | 32 | d*sc * q - dmin*m |
| Q5_K | 256 / 176 | 5-bit (8-bit storage) | 32 | d*sc * q - dmin*m |
| Q6_K | 256 / 210 | 6-bit (8-bit storage) | 16 | d*sc * (q - 32) |

Input: the raw bytes of a [N, K] tensor as uint8 [N, K / elems * bytes]; output: codes uint8
[N, K], scales and offsets float32 [N, K / group].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    name: str
    block: int  # elements per block
    nbytes: int  # bytes per block
    bits: int  # code storage width for the kernels (4 or 8)
    group: int


BLOCK_TYPES = {
    "Q4_0": BlockType("Q4_0", 32, 18, 4, 32),
    "Q4_1": BlockType("Q4_1", 32, 20, 4, 32),
    "Q5_0": BlockType("Q5_0", 32, 22, 8, 32),
    "Q5_1": BlockType("Q5_1", 32, 24, 8, 32),
    "Q8_0": BlockType("Q8_0", 32, 34, 8, 32),
    "Q2_K": BlockType("Q2_K", 256, 84, 4, 16),
    "Q3_K": BlockType("Q3_K", 256, 110, 4, 16),
    "Q4_K": BlockType("Q4_K", 256, 144, 4, 32),
    "Q5_K": BlockType("Q5_K", 256, 176, 8, 32),
    "Q6_K": BlockType("Q6_K", 256, 210, 8, 16),
}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles (elements 0..15), then high (16..31)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits_of(qh: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n/8] bytes, little-endian bit order -> [..., n] of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], n)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    s = sc.to(torch.int32)
    lo = [s[..., j] & 63 for j in range(4)]
    mlo = [s[..., j + 4] & 63 for j in range(4)]
    hi = [(s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4) for j in range(4, 8)]
    mhi = [(s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4) for j in range(4, 8)]
    return torch.stack(lo + hi, -1).float(), torch.stack(mlo + mhi, -1).float()


def _q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K: 12 bytes -> 16 six-bit scales (low 4 bits from bytes 0..7, high 2 from 8..11)."""
    s = sc.to(torch.int32)
    out = []
    for j in range(16):
        low = (s[..., j % 8] >> (4 * (j // 8))) & 0xF
        high = (s[..., 8 + j % 4] >> (2 * (j // 4))) & 3
        out.append(low | (high << 4))
    return torch.stack(out, -1).float()


def unpack_blocks(kind: str, raw: torch.Tensor, k: int):
    """raw uint8 [N, row bytes] of a [N, k] tensor -> (codes, scales, offsets)."""
    bt = BLOCK_TYPES[kind]
    N, dev = raw.shape[0], raw.device
    nb = k // bt.block
    b = raw.reshape(N, nb, bt.nbytes)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        if kind == "Q8_0":
            q = b[..., 2:34].view(torch.int8).to(torch.int16) + 128
            return _out(q, d, -128 * d, N, k)
        has_m = kind in ("Q4_1", "Q5_1")
        m = _f16(b[..., 2:4]) if has_m else None
        at = 4 if has_m else 2
        if kind.startswith("Q5"):
            hb = _bits_of(b[..., at : at + 4], 32)
            q = _nibbles(b[..., at + 4 : at + 20]) | (hb << 4)
            off = m if has_m else -16 * d
        else:
            q = _nibbles(b[..., at : at + 16])
            off = m if has_m else -8 * d
        return _out(q, d, off, N, k)
    if kind == "Q2_K":
        sc, qs = b[..., 0:16], b[..., 16:80]
        d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
        # element order: half n (32 bytes), shift s (2 bits), then the half's 32 bytes
        q = qs.view(N, nb, 2, 1, 32) >> (torch.arange(4, dtype=torch.uint8, device=dev) * 2).view(
            4, 1
        )
        q = (q & 3).reshape(N, nb, 256)
        scale = d.unsqueeze(-1) * (sc & 0xF).float()
        return _out(q, scale, -dmin.unsqueeze(-1) * (sc >> 4).float(), N, k, per_block=16)
    if kind == "Q3_K":
        hm, qs, sc = b[..., 0:32], b[..., 32:96], b[..., 96:108]
        d = _f16(b[..., 108:110])
        shifts = (torch.arange(4, dtype=torch.uint8, device=dev) * 2).view(4, 1)
        low = ((qs.view(N, nb, 2, 1, 32) >> shifts) & 3).reshape(N, nb, 256)
        # the high bit of element (half n, shift j, l) is bit 4n + j of hmask[l]
        hbit = (
            hm.view(N, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=dev).view(8, 1)
        ) & 1
        q = low | (hbit.reshape(N, nb, 256) << 2)
        scale = d.unsqueeze(-1) * (_q3_scales(sc) - 32)
        return _out(q, scale, -4 * scale, N, k, per_block=16)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        ql = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        # 4 chunks of 32 bytes: low nibbles are group 2c, high nibbles group 2c + 1
        ql = ql.view(N, nb, 4, 1, 32)
        q = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(N, nb, 256)
        if kind == "Q5_K":
            # qh[l] bit 2c (+1 for the high nibbles) is the 5th bit of group 2c's element l
            qh = b[..., 16:48].view(N, nb, 1, 32)
            hb = (qh >> torch.arange(8, dtype=torch.uint8, device=dev).view(8, 1)) & 1
            q = q | (hb.reshape(N, nb, 256) << 4)
        return _out(q, d.unsqueeze(-1) * sc, -dmin.unsqueeze(-1) * mn, N, k, per_block=8)
    if kind == "Q6_K":
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
        d = _f16(b[..., 208:210])
        ql = ql.view(N, nb, 2, 2, 32)  # half n, ql[l] / ql[l + 32]
        qh = qh.view(N, nb, 2, 1, 32)
        low = torch.stack(
            [ql[:, :, :, 0] & 0xF, ql[:, :, :, 1] & 0xF, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4],
            dim=3,
        )  # [N,nb,2,4,32]
        high = (
            qh >> (torch.arange(4, dtype=torch.uint8, device=dev) * 2).view(4, 1)
        ) & 3  # [N,nb,2,4,32]
        q = (low | (high << 4)).reshape(N, nb, 256)
        scale = d.unsqueeze(-1) * sc.view(torch.int8).float()
        return _out(q, scale, -32 * scale, N, k, per_block=16)
    raise KeyError(kind)


def _out(q, scale, offset, N: int, k: int, per_block: int = 1):
    codes = q.to(torch.uint8).reshape(N, k)
    return codes, scale.reshape(N, -1).float(), offset.reshape(N, -1).float()
