"""The linear method shared by every integer format: each shard's checkpoint tensors are kept as
loaded, then turned into codes + float32 scales/offsets by the format's `unpack`, concatenated
along N (q/k/v, gate/up) and packed once for the group-quantized kernels
(voltserve.kernels.linear.quant_linear), reached through kernels/dispatch.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import dispatch
from voltserve.kernels.linear.quant_pack import MIN_GROUP, pack_group_quant
from voltserve.services.executor.quant.staged import StagedMethod, on_rows, staged_shards
from voltserve.services.executor.tp.sharding import Cut, TensorSplit, TPSplitError

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear

logger = logging.getLogger(__name__)


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


def narrow_inputs(
    sc: ShardCodes, start: int, length: int, name: str, dtype: torch.dtype
) -> ShardCodes | torch.Tensor:
    """A row-parallel rank's input columns [start, start + length) of a whole linear's codes,
    on whole quantization groups. With act-order (perm) the rank's columns belong to any
    groups: sorted by group they are served quantized when every group's share is a multiple of
    a group size the kernels take (a power of two >= 16), else as the float weight [N, length]
    in the run dtype (dequantized by quant_pack.dequantize's rule: the same values the whole
    linear's kernels use)."""
    K, g = sc.codes.shape[1], sc.group_size
    end = start + length
    if sc.perm is None:
        if g >= K:  # per-channel: one scale per row serves every column
            return replace(sc, codes=sc.codes[:, start:end], group_size=length)
        if start % g or length % g:
            raise TPSplitError(
                f"{name}: the tensor-parallel input slice [{start}, {end}) of K={K} cuts a "
                f"quantization group of {g} columns ({K // g} groups cannot be split evenly); "
                "use a smaller --tensor-parallel-size"
            )
        a, b = start // g, end // g
        return replace(
            sc, codes=sc.codes[:, start:end], scales=sc.scales[:, a:b], offsets=sc.offsets[:, a:b]
        )
    inv = torch.argsort(sc.perm)  # original column -> its position in group order
    pos = inv[start:end].sort().values
    groups = pos // g
    local_perm = sc.perm[pos] - start
    codes = sc.codes[:, pos]
    counts = torch.bincount(groups)
    counts = counts[counts > 0]
    gp = g
    while gp >= MIN_GROUP and bool((counts % gp).any()):
        gp //= 2
    if gp >= MIN_GROUP:
        chunk = groups[::gp]
        return ShardCodes(
            codes.contiguous(), sc.scales[:, chunk], sc.offsets[:, chunk], sc.bits, gp, local_perm
        )
    s, o = sc.scales[:, groups].to(dtype).float(), sc.offsets[:, groups].to(dtype).float()
    w = (codes.float() * s + o).to(dtype)
    out = torch.empty_like(w)
    out[:, local_perm] = w
    return out


def unpack_local(
    method: GroupQuantMethod,
    staged: dict[str, torch.Tensor],
    prefix: str,
    rows: int,
    in_features: int,
    cut: Cut | None,
    dtype: torch.dtype,
) -> ShardCodes | torch.Tensor:
    """One shard's ShardCodes from its staged tensors (this rank's part of them). A
    column-parallel shard was narrowed along N at load and unpacks as is; a row-parallel one
    holds its own columns of the codes and every group's scales / zeros / g_idx (small): the
    codes are widened back to the whole K with zeros, unpacked, and narrowed to the rank's
    columns (narrow_inputs), so each format's unpack and act-order rule stay as they are."""
    if cut is None or cut.out:
        return method.unpack(staged, prefix, rows, in_features)
    wide = {k: method.split(k, prefix).widen(v, cut) for k, v in staged.items()}
    sc = method.unpack(wide, prefix, rows, cut.full)
    return narrow_inputs(sc, cut.start, cut.length, f"{prefix}.{method.required[0]}", dtype)


class GroupQuantMethod(StagedMethod):
    """Integer codes with a scale and offset per group: AWQ, GPTQ, compressed-tensors, GGUF.

    Tensor parallelism: `splits(tensor name, shard prefix)` is the format's shard rule
    (tp/sharding.py TensorSplit): how each checkpoint tensor narrows along the outputs
    (column-parallel: whole packed words) and along the inputs (row-parallel: the codes only;
    scales, zeros and g_idx stay whole until `unpack_local` cuts whole groups)."""

    def __init__(
        self,
        variant: str,
        required: list[str],
        optional: list[str],
        unpack: Unpack,
        *,
        family: str | None = None,
        splits: Callable[[str, str], TensorSplit] | None = None,
    ) -> None:
        self.variant = variant  # e.g. "AWQ GEMM 4-bit g128", for logs and errors
        self.required, self.optional = required, optional
        self.unpack = unpack
        # Methods of one family read the same tensor names and share one unpack that handles
        # each of their shards (GGUF: the ggml type is looked up per tensor), so the stacked
        # experts of a layer may mix their variants (Q4_K gate/up beside Q6_K down).
        self.family = family or variant
        self._splits = splits

    @property
    def staged_names(self) -> list[str]:
        return self.required + self.optional

    def split(self, name: str, prefix: str) -> TensorSplit:
        if self._splits is None:
            raise TPSplitError(
                f"{prefix}.{name}: {self.variant} has no tensor-parallel shard rule; use "
                "--tensor-parallel-size 1"
            )
        return super().split(name, prefix)

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        self.dtype = dtype
        layer.qweight = None
        layer.dense = None  # set instead of qweight by a row-parallel act-order fallback

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        return self.required + (["bias"] if layer.bias is not None else []), list(self.optional)

    def process_after_loading(self, layer: Linear) -> None:
        parts = []
        dev = self.device
        for prefix, shard, rows in staged_shards(layer):
            # unpacked on the run device: a GPU does it in a fraction of the CPU's time
            staged = {k: v.to(dev) for k, v in layer.staged[shard].items()}
            parts.append(
                unpack_local(
                    self, staged, prefix, rows, layer.in_features, layer.cut(shard), self.dtype
                )
            )
            layer.staged[shard] = {}
        del layer.staged
        if isinstance(parts[0], torch.Tensor):
            # a row-parallel act-order shard the kernels' groups cannot hold (narrow_inputs)
            layer.dense = parts[0]
            logger.warning(
                "%s: %s: this tensor-parallel rank's act-order input columns do not fill whole "
                "groups of 16 or more; its shard is kept as %s float weights (exact)",
                layer.prefixes[0],
                self.variant,
                self.dtype,
            )
            return
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

    def dense_weight(self, layer: Linear) -> torch.Tensor | None:
        return layer.dense

    def apply(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None):
        if layer.dense is not None:
            from voltserve.services.executor.models.layers import linear

            return linear(x, layer.dense, layer.bias, ops)
        return on_rows(dispatch.quant_linear, x, layer.qweight, layer.bias, ops)

    def apply_gate_up_silu(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch):
        if layer.dense is not None:
            return ops.silu_and_mul(self.apply(layer, x, ops))
        # decode rows on CUDA: one fused dequantize-GEMV launch with silu_and_mul in its epilogue
        return dispatch.quant_gate_up_silu(x, layer.qweight, layer.bias, ops)

    def can_fuse_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch) -> bool:
        if layer.dense is not None:
            return False
        # quant_qkv_rope picks the fused GEMV for decode rows on CUDA (no host sync, so graphs
        # hold it), else runs quant_linear then rotary_and_cache, as the unfused path does
        return x.dim() == 2 and ops is not None

    def apply_qkv_rope(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch, *args):
        return dispatch.quant_qkv_rope(x, layer.qweight, layer.bias, ops, *args)

    def scratch_numel(self, layer: Linear) -> int:
        return 0 if layer.dense is not None else layer.out_features * layer.in_features


def reserve_quant_scratch(model, ops) -> None:
    """The dequantize-then-cuBLAS path's scratch, sized for the largest quantized linear (every
    format's: LinearMethod.scratch_numel), before any CUDA graph is captured (a capture cannot
    allocate it)."""
    from voltserve.services.executor.models.layers import Linear

    sizes = [m.method.scratch_numel(m) for m in model.modules() if isinstance(m, Linear)]
    sizes = [s for s in sizes if s > 0]
    if sizes:
        dispatch.reserve_quant_scratch(ops, max(sizes))
