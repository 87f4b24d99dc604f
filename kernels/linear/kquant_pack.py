"""GGUF K-quant weights kept in their block bytes (Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625 bits a weight)
for the native kernels (kquant_gemv.py, kquant_dequant.py), and their torch reference.

Layout (`KQuantWeight`), the file's bytes and no others:

- Q4_K (144 bytes a block) and Q5_K (176): `blocks` uint8 [N, K / 256 * nbytes], the rows of
  the file as stored. Both sizes are multiples of 16, so with 16-byte aligned rows every field
  of every block (the 16-byte head d, dmin, scales[12]; Q5_K's qh[32]; qs[128]) sits on 16-byte
  boundaries and the kernels read it with 16-byte loads.
- Q6_K (210 bytes): not a multiple of 16 (a block starts 2-byte aligned), so the same bytes are
  regrouped at load into three arrays: `blocks` uint8 [N, K / 256 * 192] (each block's ql[128]
  then qh[64]), `scales` int8 [N, K / 16] (the blocks' scales[16] in order) and `d` fp16
  [N, K / 256]. Nothing is widened or recomputed: `raw_bytes` gives the file's rows back.

Meaning: gguf_blocks.unpack_blocks's rules (ggml's dequantize_row_*), `dequantize_kquant`.
Merged projections (q/k/v, gate/up) are lists of `KQuantSegment`s: consecutive shards of one
type concatenated along N, each shard keeping its own type (a Q4_K q/k beside a Q6_K v stays
4.5 + 6.56 bits, not widened to the larger).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES, unpack_blocks

KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
QK_K = 256
Q6_CODE_BYTES = 192  # ql[128] + qh[64]
Q6_SCALES = 16


@dataclass
class KQuantWeight:
    """One ggml type's rows [N, K] in their block bytes (see the module docstring)."""

    kind: str
    in_features: int  # K
    out_features: int  # N
    blocks: torch.Tensor  # uint8 [N, K / 256 * bytes]: whole blocks (Q6_K: ql + qh only)
    scales: torch.Tensor | None = None  # Q6_K: int8 [N, K / 16]
    d: torch.Tensor | None = None  # Q6_K: fp16 [N, K / 256]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nblocks(self) -> int:
        return self.in_features // QK_K

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.blocks, self.scales, self.d)
            if t is not None
        )

    def words(self) -> torch.Tensor:
        """The block bytes as the kernels read them: int32 [N, bytes / 4] (a view)."""
        return self.blocks.view(torch.int32)

    def raw_bytes(self) -> torch.Tensor:
        """uint8 [N, K / 256 * nbytes]: the rows as the file stores them."""
        if self.kind != "Q6_K":
            return self.blocks
        N, nb = self.out_features, self.nblocks
        return torch.cat(
            [
                self.blocks.view(N, nb, Q6_CODE_BYTES),
                self.scales.view(torch.uint8).view(N, nb, Q6_SCALES),
                self.d.view(torch.uint8).view(N, nb, 2),
            ],
            dim=2,
        ).view(N, -1)

    def to(self, device: torch.device | str) -> KQuantWeight:
        def move(t):
            return None if t is None else t.to(device)

        return KQuantWeight(
            self.kind,
            self.in_features,
            self.out_features,
            move(self.blocks),
            move(self.scales),
            move(self.d),
        )


def make_kquant_weight(kind: str, raw: torch.Tensor, k: int) -> KQuantWeight:
    """raw uint8 [N, K / 256 * nbytes] (a file's rows of `kind`) -> KQuantWeight [N, K]."""
    if kind not in KQUANT_TYPES:
        raise ValueError(f"{kind} is not a K-quant type the native kernels take {KQUANT_TYPES}")
    bt = BLOCK_TYPES[kind]
    if k % QK_K:
        raise ValueError(f"{kind}: K={k} is not a multiple of the block size {QK_K}")
    N, nb = raw.shape[0], k // QK_K
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (N, nb * bt.nbytes):
        raise ValueError(
            f"{kind} data of shape {tuple(raw.shape)} ({raw.dtype}) does not hold [{N}, {k}]"
        )
    if kind != "Q6_K":
        return KQuantWeight(kind, k, N, raw.contiguous())
    b = raw.reshape(N, nb, bt.nbytes)
    codes = b[..., :Q6_CODE_BYTES].reshape(N, nb * Q6_CODE_BYTES).contiguous()
    scales = b[..., Q6_CODE_BYTES : Q6_CODE_BYTES + Q6_SCALES].reshape(N, nb * Q6_SCALES)
    d = b[..., Q6_CODE_BYTES + Q6_SCALES :].contiguous().view(torch.float16).reshape(N, nb)
    return KQuantWeight(kind, k, N, codes, scales.contiguous().view(torch.int8), d)


def dequantize_kquant(w: KQuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in dtype: ggml's values computed in fp32 (gguf_blocks.unpack_blocks), rounded once."""
    codes, scales, offsets = unpack_blocks(w.kind, w.raw_bytes(), w.in_features)
    g = w.in_features // scales.shape[1]
    wf = codes.float() * scales.repeat_interleave(g, 1) + offsets.repeat_interleave(g, 1)
    return wf.to(dtype)


@dataclass
class KQuantSegment:
    """Output rows [start, start + weight.out_features) of a merged linear, of one type."""

    start: int
    weight: KQuantWeight


def segments_of(parts: list[KQuantWeight]) -> list[KQuantSegment]:
    """The shards of a merged linear (in output order) as segments: consecutive shards of one
    type concatenated along N (one launch each), shards of other types kept apart."""
    out: list[KQuantSegment] = []
    start = 0
    for p in parts:
        if out and out[-1].weight.kind == p.kind:
            prev = out[-1].weight
            out[-1] = KQuantSegment(out[-1].start, _cat_rows(prev, p))
        else:
            out.append(KQuantSegment(start, p))
        start += p.out_features
    return out


def _cat_rows(a: KQuantWeight, b: KQuantWeight) -> KQuantWeight:
    def cat(x, y):
        return None if x is None else torch.cat([x, y])

    return KQuantWeight(
        a.kind,
        a.in_features,
        a.out_features + b.out_features,
        torch.cat([a.blocks, b.blocks]),
        cat(a.scales, b.scales),
        cat(a.d, b.d),
    )


__all__ = [
    "KQUANT_TYPES",
    "KQuantSegment",
    "KQuantWeight",
    "dequantize_kquant",
    "make_kquant_weight",
    "segments_of",
]
