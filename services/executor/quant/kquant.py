"""The linear method of GGUF K-quant weights kept in their block bytes (Q4_K, Q6_K): each shard's
rows stay as the file stores them (kernels/linear/kquant_pack.py: Q6_K's fields regrouped, no
byte added), so the weights take the file's size on the GPU. Served by the K-quant kernels
through kernels/dispatch.kquant_linear: the GEMV reading the blocks at decode rows, a dequantize
into the quantized formats' shared scratch then cuBLAS above.

A merged linear keeps every shard in its own type (kquant_pack.segments_of: a Q4_K q/k beside a
Q6_K v is two segments, two launches), where the group-quantized method widens every shard to the
largest code width. Chosen by the GGUF config when kernels/linear/kquant_linear.native_enabled
(VOLTSERVE_GGUF_KQUANT) and every shard is a type the GEMV reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import dispatch
from voltserve.kernels.linear.kquant_pack import make_kquant_weight, segments_of
from voltserve.services.executor.quant.staged import StagedMethod, on_rows, staged_shards
from voltserve.services.executor.tp.sharding import TensorSplit

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear


class KQuantMethod(StagedMethod):
    """GGUF K-quant rows in their blocks. kinds: each shard prefix's (ggml type, tensor name).

    Tensor parallelism: the GGUF rule (whole rows along the outputs, whole blocks along the
    inputs); a block is self-contained, so a rank's blocks are served as they are."""

    def __init__(
        self,
        variant: str,
        kinds: dict[str, tuple[str, str]],
        splits: Callable[[str, str], TensorSplit | None],
    ) -> None:
        self.variant = variant
        self.kinds = kinds
        self._splits = splits

    @property
    def staged_names(self) -> list[str]:
        return ["weight"]

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.kquant = None

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        return ["weight"] + (["bias"] if layer.bias is not None else []), []

    def process_after_loading(self, layer: Linear) -> None:
        parts = []
        for prefix, shard, rows in staged_shards(layer):
            kind, gname = self.kinds[prefix]
            raw = layer.staged[shard]["weight"]
            if raw.shape[0] != rows:
                raise ValueError(f"{gname}: {kind} data has {raw.shape[0]} rows, expected {rows}")
            try:
                w = make_kquant_weight(kind, raw, layer.in_features)
            except ValueError as e:
                raise ValueError(f"{gname}: {e}") from e
            parts.append(w.to(self.device))
            layer.staged[shard] = {}
        del layer.staged
        layer.kquant = segments_of(parts)

    def apply(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None):
        return on_rows(dispatch.kquant_linear, x, layer.kquant, layer.bias, ops)

    def apply_gate_up_silu(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch):
        if x.dim() != 2:
            return ops.silu_and_mul(self.apply(layer, x, ops))
        return dispatch.kquant_gate_up_silu(x, layer.kquant, layer.bias, ops)

    def scratch_numel(self, layer: Linear) -> int:
        return layer.out_features * layer.in_features


__all__ = ["KQuantMethod"]
