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
    by one all-reduce (rank 0 alone adds the bias before it). reduce=False leaves the sum to
    the caller (an MoE block sums its experts and shared expert first, then reduces once)."""

    group: TPGroup
    start: int
    length: int
    reduce: bool = True


Parallel = ColumnParallel | RowParallel


def column_parallel(
    tp: TPGroup | None, slices: dict[Shard, tuple[int, int]]
) -> ColumnParallel | None:
    """A ColumnParallel of `slices`, or None (the whole linear) without a group."""
    return None if tp is None else ColumnParallel(tp, slices)


def row_parallel(tp: TPGroup | None, start: int, length: int) -> RowParallel | None:
    """A RowParallel of input columns [start, start + length), or None without a group."""
    return None if tp is None else RowParallel(tp, start, length)


@dataclass(frozen=True)
class Cut:
    """One rank's part of one linear shard: output rows [start, start + length) of `full`
    (column-parallel, out=True) or input columns of `full` (row-parallel, out=False)."""

    out: bool
    start: int
    length: int
    full: int
    rank0: bool  # a row-parallel bias lives on rank 0 only (added once before the reduce)


@dataclass(frozen=True)
class TensorSplit:
    """How one checkpoint tensor of a quantized linear narrows under a Cut. out_dim / in_dim:
    the tensor's dimension along the linear's outputs / inputs (None: the tensor is whole on
    every rank along it). pack logical values are stored in nbytes elements along that dim
    (8 int4 per int32: pack 8, nbytes 1; a group's scale row: pack g; a GGUF block of 256
    values in 144 bytes: pack 256, nbytes 144)."""

    out_dim: int | None
    out_pack: int = 1
    in_dim: int | None = None
    in_pack: int = 1
    in_nbytes: int = 1
    shape_of: bool = False  # a [2] tensor holding the linear's (N, K) (compressed-tensors)

    def narrow(self, tensor: torch.Tensor, cut: Cut, name: str) -> torch.Tensor:
        if self.shape_of:
            # the unpacker checks it against the shard it unpacks: a column-parallel rank's
            # rows, a row-parallel rank's whole K (it unpacks the widened codes)
            if int(tensor[0 if cut.out else 1]) != cut.full:
                raise ValueError(
                    f"{name}: {tensor.tolist()}, model expects {cut.full} "
                    f"{'rows' if cut.out else 'input columns'}"
                )
            if not cut.out:
                return tensor
            out = tensor.clone()
            out[0] = cut.length
            return out
        if cut.out:
            if self.out_dim is None:
                return tensor
            return narrow(tensor, self.out_dim, cut.start, cut.length, name, self.out_pack)
        if self.in_dim is None:
            return tensor
        return narrow(
            tensor, self.in_dim, cut.start, cut.length, name, self.in_pack, nbytes=self.in_nbytes
        )

    def widen(self, tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
        """The inverse of a row-parallel narrow: the full input width, zeros outside the cut
        (the unpackers check and unpack logical shapes; the zeros are cut away after)."""
        if cut.out or self.in_dim is None:
            return tensor
        d, per = self.in_dim, self.in_nbytes
        shape = list(tensor.shape)
        shape[d] = cut.full // self.in_pack * per
        out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
        out.narrow(d, cut.start // self.in_pack * per, tensor.shape[d]).copy_(tensor)
        return out


def narrow(
    tensor: torch.Tensor,
    dim: int,
    start: int,
    length: int,
    name: str,
    pack: int = 1,
    unit: int = 1,
    nbytes: int = 1,
) -> torch.Tensor:
    """tensor's logical slice [start, start + length) along dim. pack: logical values per
    `nbytes` stored elements along dim (a packed int4 dimension: 8 per 1; a GGUF block: 32
    values in 18 bytes); unit: a block that must stay whole (a quantization group). Rows past
    the tensor's end come back as zeros (vocabulary padding)."""
    step = math.lcm(pack, unit)
    if start % step or length % step:
        what = "a packed int" if nbytes == 1 else "a quantization block"
        raise TPSplitError(
            f"tensor {name!r}: the tensor-parallel slice [{start}, {start + length}) of dim {dim} "
            f"cuts {what if start % pack or length % pack else 'a quantization group'} "
            f"(packing {pack}, group {unit}); use a smaller --tensor-parallel-size"
        )
    s, n = start // pack * nbytes, length // pack * nbytes
    have = tensor.shape[dim]
    if s + n <= have:
        return tensor.narrow(dim, s, n)
    shape = list(tensor.shape)
    shape[dim] = n
    out = torch.zeros(shape, dtype=tensor.dtype)
    if s < have:
        out.narrow(dim, 0, have - s).copy_(tensor.narrow(dim, s, have - s))
    return out
