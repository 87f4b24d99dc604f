"""The linear method shared by every integer format: each shard's checkpoint tensors are kept as
loaded, then turned into codes + float32 scales/offsets by the format's `unpack`, concatenated
along N (q/k/v, gate/up) and packed once for the group-quantized kernels
(voltserve.kernels.quant_linear)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import quant_linear as qk
from voltserve.kernels.quant_pack import pack_group_quant
from voltserve.services.executor.quant.base import LinearMethod, Shard, copy_into_bias

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear


@dataclass
class ShardCodes:
    """One shard as the kernels take it: w[n, k] = codes[n, k] * scales[n, k // g] + offsets[...]
    (in the permuted input order when perm is set)."""

    codes: torch.Tensor  # uint8 [n, K]
    scales: torch.Tensor  # float32 [n, K // g]
    offsets: torch.Tensor  # float32 [n, K // g]
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]


# unpack(tensors by name, shard prefix, rows of the shard, in_features) -> ShardCodes
Unpack = Callable[[dict[str, torch.Tensor], str, int, int], ShardCodes]


def unpack_int32(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 // bits fields each, field j at bits [j * bits, (j + 1) * bits):
    the fields become consecutive elements along `dim` (uint8)."""
    per = 32 // bits
    w = x.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=x.device) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per] along the last dim
    v = v.movedim(-1, dim + 1) if dim != x.dim() - 1 else v
    shape = list(x.shape)
    shape[dim] *= per
    return v.reshape(shape).to(torch.uint8)


def act_order_perm(g_idx: torch.Tensor, group: int, name: str, variant: str) -> torch.Tensor | None:
    """The input permutation that makes GPTQ act-order groups contiguous (None: already are).
    Refuses a g_idx whose groups are not exactly `group` columns each."""
    K = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(K, dtype=torch.int64, device=g_idx.device) // group
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(
            f"{name}: {variant} g_idx does not put exactly {group} input columns in each group "
            "(cannot be made contiguous)"
        )
    return perm


def check_shape(t: torch.Tensor, want: tuple[int, ...], name: str, variant: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(
            f"{name}: {variant} expects shape {tuple(want)}, checkpoint has {tuple(t.shape)}"
        )


def merge_shards(parts: list[ShardCodes], names: list[str]) -> ShardCodes:
    """Concatenate shards along N. Shards of different bits or group sizes (a GGUF file mixes
    Q4_K q/k with Q6_K v) are widened to the largest bits and the smallest group, which
    represents every shard exactly (codes unchanged, scales repeated)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    for p, n in zip(parts, names):
        if p.group_size % group:
            raise ValueError(f"{n}: group size {p.group_size} is not a multiple of {group}")
    perms = [p.perm for p in parts]
    if any(q is None for q in perms) != all(q is None for q in perms) or (
        perms[0] is not None and not all(torch.equal(perms[0], q) for q in perms[1:])
    ):
        raise ValueError(
            f"{', '.join(names)}: act-order g_idx differs between the shards of a merged linear "
            "(one input permutation per linear)"
        )

    def widen(t: torch.Tensor, g: int) -> torch.Tensor:
        return t if g == group else t.repeat_interleave(g // group, dim=1)

    return ShardCodes(
        torch.cat([p.codes for p in parts]),
        torch.cat([widen(p.scales, p.group_size) for p in parts]),
        torch.cat([widen(p.offsets, p.group_size) for p in parts]),
        bits,
        group,
        perms[0],
    )


class GroupQuantMethod(LinearMethod):
    """Integer codes with a scale and offset per group: AWQ, GPTQ, compressed-tensors, GGUF."""

    def __init__(
        self,
        variant: str,
        required: list[str],
        optional: list[str],
        unpack: Unpack,
        family: str | None = None,
    ) -> None:
        self.variant = variant  # e.g. "AWQ GEMM 4-bit g128", for logs and errors
        self.required, self.optional = required, optional
        self.unpack = unpack
        # Methods of one family read the same tensor names and share one unpack that handles
        # each of their shards (GGUF: the ggml type is looked up per tensor), so the stacked
        # experts of a layer may mix their variants (Q4_K gate/up beside Q6_K down).
        self.family = family or variant

    def describe(self) -> str:
        return self.variant

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer.staged = {shard: {} for shard in layer.shard_offsets}
        layer.qweight = None

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        return self.required + (["bias"] if layer.bias is not None else []), list(self.optional)

    def load(self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        if name == "bias":
            copy_into_bias(layer, shard, tensor)
        elif name in self.required or name in self.optional:
            layer.staged[shard][name] = tensor
        else:
            raise KeyError(f"{self.variant} linear has no tensor {name!r}")

    def process_after_loading(self, layer: Linear) -> None:
        parts = []
        dev = self.device
        for prefix, (shard, (_, rows)) in zip(layer.prefixes, layer.shard_offsets.items()):
            # unpacked on the run device: a GPU does it in a fraction of the CPU's time
            staged = {k: v.to(dev) for k, v in layer.staged[shard].items()}
            parts.append(self.unpack(staged, prefix, rows, layer.in_features))
            layer.staged[shard] = {}
        m = merge_shards(parts, layer.prefixes)
        try:
            layer.qweight = pack_group_quant(
                m.codes.to(dev),
                m.scales.to(dev),
                m.offsets.to(dev),
                m.bits,
                m.group_size,
                self.dtype,
                None if m.perm is None else m.perm.to(dev),
            )
        except ValueError as e:
            raise ValueError(f"{layer.prefixes[0]}: {self.variant}: {e}") from e
        del layer.staged

    def apply(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None):
        if x.dim() != 2:
            shape = x.shape
            y = qk.quant_linear(x.reshape(-1, shape[-1]), layer.qweight, layer.bias, ops)
            return y.view(*shape[:-1], y.shape[-1])
        return qk.quant_linear(x, layer.qweight, layer.bias, ops)

    def apply_gate_up_silu(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch):
        # decode rows on CUDA: one fused dequantize-GEMV launch with silu_and_mul in its epilogue
        return qk.quant_gate_up_silu(x, layer.qweight, layer.bias, ops)

    def can_fuse_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch) -> bool:
        # quant_qkv_rope picks the fused GEMV for decode rows on CUDA (no host sync, so graphs
        # hold it), else runs quant_linear then rotary_and_cache, as the unfused path does
        return x.dim() == 2 and ops is not None

    def apply_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch, *args):
        return qk.quant_qkv_rope(x, layer.qweight, layer.bias, ops, *args)

    def weight_numel(self, layer: Linear) -> int:
        return layer.out_features * layer.in_features


def reserve_quant_scratch(model, ops) -> None:
    """The dequantize-then-cuBLAS path's scratch, sized for the largest quantized linear, before
    any CUDA graph is captured (a capture cannot allocate it)."""
    from voltserve.services.executor.models.layers import Linear

    sizes = [
        m.method.weight_numel(m)
        for m in model.modules()
        if isinstance(m, Linear) and isinstance(m.method, GroupQuantMethod)
    ]
    if sizes:
        qk.reserve_scratch(ops, max(sizes))
