"""How far a fused norm + NeoX-rotary kernel may be from its reference in fp16, for every draw.

The kernel and the reference round the normalised value to fp16 before the rotation, but their
sums of squares add in different orders, so a normalised element may round the other way: one
ulp of that element. The rotation mixes it with its partner (x1 cos - x2 sin, each product
rounded to fp16 as the reference does): the moved input shifts the result by up to
ulp(m) * (|cos| + |sin|) <= 1.42 ulp(m), m = max(|x1|, |x2|); each of the two products may then
round the other way (up to one ulp of m each); and the result rounds once more. So the bound is
3.5 ulp(m) + ulp(result), however small the result is (cancellation). A fixed atol/rtol holds
for most draws but not all: at 8192 tokens a result near zero whose operands lie in [4, 8) was
off by 0.0039, one in [1, 2) by 0.00195."""

from __future__ import annotations

import torch


def f16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp16 numbers at |x| (subnormal spacing below 2**-14)."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(2.0**-14)))
    return torch.exp2(e - 10)


def rotated_bound(normed: torch.Tensor, head_dim: int, rotary_dim: int, ref: torch.Tensor):
    """Per-element bound on |kernel - ref| for rows [T, heads * head_dim] whose normalised,
    fp16-rounded values before the rotation are `normed` (same shape)."""
    T = normed.shape[0]
    h = normed.float().abs().view(T, -1, head_dim)
    m = h.clone()
    half = rotary_dim // 2
    m[..., :half] = torch.maximum(h[..., :half], h[..., half:rotary_dim])
    m[..., half:rotary_dim] = m[..., :half]
    return (3.5 * f16_ulp(m)).view(T, -1) + f16_ulp(ref)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element within its bound; NaN only where the reference has NaN (poisoned slots)."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), "NaN where the reference has a value, or not"
    err = (out.float() - ref.float()).abs().masked_fill(nan, 0)
    excess = err - bound.masked_fill(nan, 0)
    worst = int(excess.flatten().argmax())
    assert excess.max().item() <= 0, (
        f"{int((excess > 0).sum())} elements past their bound; worst at flat index {worst}: "
        f"|diff| {err.flatten()[worst].item():.3g}, bound {bound.flatten()[worst].item():.3g}"
    )
