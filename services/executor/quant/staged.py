"""What the packed formats' linear methods share (group.py: the integer formats; fp4.py: FP4):
each shard's checkpoint tensors are kept as loaded (`layer.staged`) until process_after_loading
packs them; tensor parallelism narrows each tensor in the format's own units (`split`); the
kernels take 2-D rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from voltserve.services.executor.quant.base import (
    LinearMethod,
    Shard,
    copy_into_bias,
    float_local_tensor,
)

if TYPE_CHECKING:
    from voltserve.services.executor.models.layers import Linear
    from voltserve.services.executor.tp.sharding import Cut, TensorSplit


def check_shape(t: torch.Tensor, want: tuple[int, ...], name: str, variant: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(
            f"{name}: {variant} expects shape {tuple(want)}, checkpoint has {tuple(t.shape)}"
        )


def on_rows(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn(rows, *args) over x flattened to 2-D rows [-1, K], given back in x's leading shape."""
    if x.dim() == 2:
        return fn(x, *args)
    y = fn(x.reshape(-1, x.shape[-1]), *args)
    return y.view(*x.shape[:-1], y.shape[-1])


class StagedMethod(LinearMethod):
    """A packed format's linear: `variant` names it in logs and errors, `staged_names` are the
    checkpoint tensors it keeps per shard, `split` its tensor-parallel rule per tensor."""

    variant: str
    # The format's shard rule per (tensor name, shard prefix); None from it: no such tensor.
    _splits: Callable[[str, str], TensorSplit | None] | None = None

    @property
    def staged_names(self) -> list[str]:
        raise NotImplementedError

    def split(self, name: str, prefix: str) -> TensorSplit:
        if self._splits is None:
            raise NotImplementedError
        split = self._splits(name, prefix)
        if split is None:
            raise KeyError(f"{self.variant} linear has no tensor {name!r}")
        return split

    def describe(self) -> str:
        return self.variant

    def local_tensor(
        self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor, cut: Cut
    ) -> torch.Tensor:
        if name == "bias":
            return float_local_tensor(name, tensor, cut)
        prefix = layer.prefixes[list(layer.shard_offsets).index(shard)]
        return self.split(name, prefix).narrow(tensor, cut, f"{prefix}.{name}")

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer.staged = {shard: {} for shard in layer.shard_offsets}

    def load(self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        if name == "bias":
            copy_into_bias(layer, shard, tensor)
        elif name in self.staged_names:
            layer.staged[shard][name] = tensor
        else:
            raise KeyError(f"{self.variant} linear has no tensor {name!r}")


def staged_shards(layer: Linear) -> Iterator[tuple[str, Shard, int]]:
    """(checkpoint prefix, shard, rows) of each shard of the linear, in order."""
    for prefix, (shard, (_, rows)) in zip(layer.prefixes, layer.shard_offsets.items()):
        yield prefix, shard, rows
