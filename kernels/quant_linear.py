"""Group-quantized linears: y = x W^T with W stored as integer codes plus a float32 scale and
offset per group of `group_size` consecutive input columns.

    w[n, k] = codes[n, k] * scales[n, k // g] + offsets[n, k // g]

Every quantized checkpoint format (AWQ, GPTQ, compressed-tensors, the GGUF block types) is
mapped onto this one form by its loader (services/executor/quant/). This file holds the torch
reference that defines the meaning; the numba kernels that run it on the GPU plug in behind the
same three functions (pack_group_quant, quant_linear, dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass
class GroupQuantWeight:
    codes: torch.Tensor  # uint8 [N, K], each < 2**bits
    scales: torch.Tensor  # float32 [N, K // g]
    offsets: torch.Tensor  # float32 [N, K // g]
    bits: int
    group_size: int
    dtype: torch.dtype  # the activations' dtype (what dequantize returns)
    perm: torch.Tensor | None = None  # int64 [K]: y = x[:, perm] @ W^T

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


def pack_group_quant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
) -> GroupQuantWeight:
    N, K = codes.shape
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if group_size not in GROUP_SIZES and group_size != K:
        raise ValueError(f"group size {group_size} is not one of {GROUP_SIZES} or K={K}")
    if K % group_size:
        raise ValueError(f"group size {group_size} does not divide K={K}")
    want = (N, K // group_size)
    if tuple(scales.shape) != want or tuple(offsets.shape) != want:
        raise ValueError(f"scales/offsets must be {want}, got {tuple(scales.shape)}")
    if perm is not None and tuple(perm.shape) != (K,):
        raise ValueError(f"perm must be [{K}], got {tuple(perm.shape)}")
    return GroupQuantWeight(
        codes.to(torch.uint8).contiguous(),
        scales.float().contiguous(),
        offsets.float().contiguous(),
        bits,
        group_size,
        dtype,
        None if perm is None else perm.long().contiguous(),
    )


def dequantize(w: GroupQuantWeight) -> torch.Tensor:
    """The [N, K] weight (in the permuted input order when w.perm is set), in w.dtype."""
    g = w.group_size
    s = w.scales.repeat_interleave(g, dim=1)
    o = w.offsets.repeat_interleave(g, dim=1)
    return (w.codes.float() * s + o).to(w.dtype)


def quant_linear(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None, ops=None
) -> torch.Tensor:
    if w.perm is not None:
        x = x[:, w.perm]
    return F.linear(x, dequantize(w), bias)


def quant_gate_up_silu(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None, ops=None
) -> torch.Tensor:
    """silu_and_mul(quant_linear(x, w, bias)) for a merged [2I, K] gate_up weight."""
    y = quant_linear(x, w, bias, ops)
    i = y.shape[-1] // 2
    return F.silu(y[..., :i]) * y[..., i:]
