"""The quantization seam: how one linear layer is stored, loaded and multiplied.

A model names its linears and their logical shapes (`Linear(in_features, shard_sizes, bias)`);
each Linear holds a `LinearMethod`, chosen per linear by the checkpoint's `QuantConfig`, that

- `create_weights`: registers the linear's parameters (or staging room for packed tensors);
- `checkpoint_tensors`: names the checkpoint tensors one shard of it reads (required, optional);
- `load`: takes one checkpoint tensor of one shard (q/k/v, gate/up, or the whole linear);
- `process_after_loading`: converts what was loaded into the form its kernels run (once);
- `apply` / `apply_gate_up_silu` / `apply_qkv_rope`: the products, by row count.

The model code never looks at the format; it calls its Linear, which calls the method.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear
    from voltserve.services.executor.tp.sharding import Cut

Shard = str | int | None


class QuantFormatError(ValueError):
    """A checkpoint's quantization we cannot serve exactly; names the tensor and the variant."""


class LinearMethod:
    """Base: a linear with a bias parameter (when asked) and whatever weights a format needs."""

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        layer.bias = (
            nn.Parameter(torch.empty(layer.out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        """(required, optional) tensor names per shard, e.g. (["qweight", "scales"], ["g_idx"])."""
        raise NotImplementedError

    def local_tensor(
        self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor, cut: Cut
    ) -> torch.Tensor:
        """Tensor parallelism: the part of one checkpoint tensor (of its logical shape) that
        this rank holds. Here a float [N, K] weight and an [N] bias: rows of a column-parallel
        cut, columns of a row-parallel one; a row-parallel bias on rank 0 only (zeros on the
        others: the all-reduce adds it once). A packed format narrows in its own units."""
        return float_local_tensor(name, tensor, cut)

    def load(self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def process_after_loading(self, layer: Linear) -> None:
        """Called once after every tensor is loaded."""

    def apply(
        self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def apply_gate_up_silu(
        self, layer: Linear, x: torch.Tensor, ops: KernelDispatch
    ) -> torch.Tensor:
        """silu_and_mul(layer(x)) for a merged gate_up linear; a method may fuse it."""
        return ops.silu_and_mul(self.apply(layer, x, ops))

    def can_fuse_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch) -> bool:
        """Whether apply_qkv_rope runs for these rows (qkv projection + rotary + KV-cache write
        in one launch); otherwise the model runs the projection and rotary_and_cache."""
        return False

    def apply_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch, *args):
        raise NotImplementedError

    def dense_weight(self, layer: Linear) -> torch.Tensor | None:
        """The [N, K] float weight when the method keeps one (the GEMV plan times those)."""
        return None

    def scratch_numel(self, layer: Linear) -> int:
        """Elements of the dequantize-then-cuBLAS scratch this linear needs (0: none)."""
        return 0

    def describe(self) -> str:
        return type(self).__name__


def float_local_tensor(name: str, tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    from voltserve.services.executor.tp.sharding import narrow

    if cut.out:
        if tensor.shape[0] != cut.full:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects "
                f"{cut.full} rows"
            )
        return narrow(tensor, 0, cut.start, cut.length, name)
    if name == "bias":
        return tensor if cut.rank0 else torch.zeros_like(tensor)
    if tensor.dim() != 2 or tensor.shape[1] != cut.full:
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects "
            f"{cut.full} input columns"
        )
    return narrow(tensor, 1, cut.start, cut.length, name)


def copy_into_bias(layer: Linear, shard: Shard, tensor: torch.Tensor) -> None:
    if layer.bias is None:
        raise ValueError("checkpoint has a bias the model does not expect")
    start, size = layer.shard_offsets[shard]
    target = layer.bias.data.narrow(0, start, size)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(tensor.shape)}, "
            f"model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)


class UnquantizedMethod(LinearMethod):
    """A float weight [N, K] in the run dtype: today's fp16/fp32 path, with its GEMV kernels and
    the gate_up+SiLU and qkv+rotary+KV-write fusions."""

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        return ["weight"] + (["bias"] if layer.bias is not None else []), []

    def load(self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        if name == "bias":
            copy_into_bias(layer, shard, tensor)
            return
        if name != "weight":
            raise KeyError(f"linear has no parameter {name!r}")
        start, size = layer.shard_offsets[shard]
        target = layer.weight.data.narrow(0, start, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def apply(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None):
        from voltserve.services.executor.models.layers import linear

        return linear(x, layer.weight, layer.bias, ops)

    def apply_gate_up_silu(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch):
        from voltserve.services.executor.linear_plan import GEMV, GEMV_GATE_UP, gate_up_impl

        w, b = layer.weight, layer.bias
        if x.dim() != 2:
            return ops.silu_and_mul(self.apply(layer, x, ops))
        impl = gate_up_impl(ops, x.shape[0], w.shape[0], w.shape[1])
        if impl == GEMV_GATE_UP:
            return ops.gemv_gate_up(x, w, b)
        if impl == GEMV:
            return ops.silu_and_mul(ops.gemv(x, w, b))
        return ops.silu_and_mul(F.linear(x, w, b))

    def can_fuse_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch) -> bool:
        """Decode rows the plan sends to the GEMV kernel. On CUDA only where the fused kernel
        itself runs (its reference syncs, so no graph could hold it); on CPU the reference, so
        the CPU tests walk the same path."""
        from voltserve.services.executor.linear_plan import GEMV, linear_impl

        w = layer.weight
        return (
            x.dim() == 2
            and (ops.impl["gemv_qkv_rope"] == "cuda" or ops.device.type == "cpu")
            and linear_impl(ops, x.shape[0], w.shape[0], w.shape[1]) == GEMV
        )

    def apply_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch, *args):
        positions, cos_sin_cache, k_cache, v_cache, slots, num_heads, num_kv_heads = args
        return ops.gemv_qkv_rope(
            x,
            layer.weight,
            layer.bias,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slots,
            num_heads,
            num_kv_heads,
        )

    def dense_weight(self, layer: Linear) -> torch.Tensor | None:
        return layer.weight


def module_listed(name: str, entries: Iterable[str]) -> bool:
    """Whether a list of module names such as AWQ's `modules_to_not_convert` names the module
    `name`: an entry matches when its dotted components are a contiguous run of the name's
    (`mlp.gate` names model.layers.0.mlp.gate; `model.layers.3` everything under layer 3).
    Whole components, not substrings: AutoAWQ lists an MoE router as `mlp.gate`, and a
    substring test would leave a dense layer's mlp.gate_proj float too, whose float weight
    the checkpoint does not have."""
    parts = name.split(".")
    for entry in entries:
        want = entry.split(".")
        n = len(want)
        if any(parts[i : i + n] == want for i in range(len(parts) - n + 1)):
            return True
    return False


class QuantConfig:
    """A checkpoint's quantization: picks each linear's method."""

    name = "none"

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        """prefixes: the checkpoint names of the linear's shards (e.g. the q/k/v_proj of one
        merged qkv_proj), without the tensor suffix."""
        return UnquantizedMethod()

    def one_method(self, prefixes: list[str]) -> bool:
        """Whether the linears named by `prefixes` take the same method on their own, so one
        merged linear can hold them all (a checkpoint may keep some of them float: Qwen3.5's
        in_proj_b / in_proj_a beside a quantized in_proj_qkv / in_proj_z)."""
        return len({self.method_for([p]).describe() for p in prefixes}) == 1

    def describe(self) -> str:
        return self.name


UNQUANTIZED = QuantConfig()
