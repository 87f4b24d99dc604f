"""How a tensor-parallel rank narrows a linear: which slice of each logical output shard a
column-parallel linear holds, which slice of the input a row-parallel one holds, and the narrowing
of a checkpoint tensor to that slice.

A quantization method narrows the same way, in its own units: `narrow` takes the packing factor
of the dimension it cuts (8 int4 values per int32 along a packed dimension) and the group size
along it (a scale per 128 input columns), and refuses a slice that would cut a packed int or a
quantization group with an error naming the tensor, instead of loading a wrong shard."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from voltserve.services.executor.tp.group import TPGroup

Shard = str | int | None


class TPSplitError(ValueError):
    """A model dimension that the tensor-parallel size cannot split; says which and why."""


def split_range(total: int, rank: int, size: int, what: str, unit: int = 1) -> tuple[int, int]:
    """(start, length) of rank's equal share of `total`, in whole `unit`s."""
    if total % (size * unit):
        extra = f" in units of {unit}" if unit > 1 else ""
        raise TPSplitError(
            f"{what} = {total} cannot be split evenly{extra} across tensor-parallel size {size}"
        )
    n = total // size
    return rank * n, n


@dataclass(frozen=True)
class ColumnParallel:
    """This rank computes the output columns `slices[shard] = (start, length)` of each logical
    output shard (q/k/v, gate/up, or the whole linear). A slice may end past the checkpoint's
    rows (the padded vocabulary of the lm_head): those rows are zeros."""

    group: TPGroup
    slices: dict[Shard, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class RowParallel:
    """This rank holds input columns [start, start + length); the partial products are summed
    by one all-reduce, then the (whole, unsplit) bias is added."""

    group: TPGroup
    start: int
    length: int


Parallel = ColumnParallel | RowParallel


def narrow(
    tensor: torch.Tensor,
    dim: int,
    start: int,
    length: int,
    name: str,
    pack: int = 1,
    unit: int = 1,
) -> torch.Tensor:
    """tensor's logical slice [start, start + length) along dim. pack: logical values per stored
    element along dim (a packed int4 dimension: 8); unit: a block that must stay whole (a
    quantization group). Rows past the tensor's end come back as zeros (vocabulary padding)."""
    step = math.lcm(pack, unit)
    if start % step or length % step:
        raise TPSplitError(
            f"tensor {name!r}: the tensor-parallel slice [{start}, {start + length}) of dim {dim} "
            f"cuts {'a packed int' if start % pack or length % pack else 'a quantization group'} "
            f"(packing {pack}, group {unit}); use a smaller --tensor-parallel-size"
        )
    s, n = start // pack, length // pack
    have = tensor.shape[dim]
    if s + n <= have:
        return tensor.narrow(dim, s, n)
    shape = list(tensor.shape)
    shape[dim] = n
    out = torch.zeros(shape, dtype=tensor.dtype)
    if s < have:
        out.narrow(dim, 0, have - s).copy_(tensor.narrow(dim, s, have - s))
    return out
