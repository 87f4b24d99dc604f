"""The mixture-of-experts layer that a decoder block uses in place of its MLP: a router (a linear
to E logits, softmax in fp32, top-k, the family's normalisation), the routed experts stored
stacked per layer, and for Qwen2-MoE a shared expert behind a sigmoid gate.

Families (transformers' modeling code is the reference for each):
- Qwen3-MoE: top-k of E, renormalised when norm_topk_prob (true in the released models); no
  shared expert. Dense layers where `mlp_only_layers` or `decoder_sparse_step` say so.
- Qwen2-MoE: top-k without renormalisation unless norm_topk_prob; plus a shared expert (a gated
  MLP of shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate(x)).
- Mixtral: top-2 of 8, always renormalised, routing weights kept in fp32. Checkpoint names
  block_sparse_moe.experts.N.w1 (gate) / w3 (up) / w2 (down).

Quantization seam: `FusedExperts` is to the experts what `layers.Linear` is to a linear: it
holds an `ExpertsMethod` (the same four steps as a linear's method: create_weights, load,
process_after_loading, apply), chosen by `experts_method` from what the checkpoint's
quantization config says of each expert projection. `UnquantizedExperts` stores w13 [E, 2I, H]
and w2 [E, H, I] and runs `ops.moe_experts`; quant/experts.py `GroupQuantExperts` (AWQ, GPTQ,
compressed-tensors) stacks each expert's packed codes/scales/offsets per layer and lists the
per-expert tensor names the format has (`checkpoint_params`); quant/fp4_experts.py `Fp4Experts`
(the FP4 formats) stacks each expert's FP4 codes and scale bytes. The model and the loader stay
the same.

Tensor parallelism (vLLM's layout): every expert's intermediate dim is split across the ranks
(gate/up rows column-parallel, down columns row-parallel, each method narrowing its own
tensors through `FusedExperts.cut`), the shared expert's the same, the routers replicated;
the block sums its experts' weighted partial products and the shared expert's and reduces
them with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from voltserve.kernels import dispatch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import Linear, gate_up_silu
from voltserve.services.executor.quant.base import (
    UNQUANTIZED,
    QuantConfig,
    QuantFormatError,
    UnquantizedMethod,
    float_local_tensor,
)
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import ColumnParallel, Cut, RowParallel

# Per family: the checkpoint leaf name of each expert projection -> (our parameter, part):
# part 0 = gate rows of w13, 1 = up rows of w13, None = w2.
EXPERT_NAMES = {
    "qwen": {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)},
    "mixtral": {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)},
}


class ExpertsMethod:
    """How one layer's stacked experts are stored, loaded and multiplied (the experts' side of
    the quantization seam; a linear's `LinearMethod` has the same four steps)."""

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def checkpoint_params(
        self, layer: FusedExperts
    ) -> dict[str, tuple[str, tuple[int, int | None]]]:
        """Checkpoint name relative to the experts module -> (parameter, (expert, part)); part
        0/1 = the gate/up rows of w13, None = the whole of w2[expert]. A quantized method lists
        its own tensors (qweight, scales, ...) per expert projection."""
        out = {}
        for e in range(layer.num_experts):
            for leaf, (param, part) in layer.names.items():
                out[f"{e}.{leaf}.weight"] = (param, (e, part))
        return out

    def load(
        self, layer: FusedExperts, name: str, shard: tuple[int, int | None], t: torch.Tensor
    ) -> None:
        raise NotImplementedError

    def process_after_loading(self, layer: FusedExperts) -> None:
        """Called once after every tensor is loaded (repacking for a kernel goes here)."""

    def apply(
        self,
        layer: FusedExperts,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def reference_on_used_experts(
        layer: FusedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        dense: Callable[[str, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """moe_experts_ref over only the experts that received a token, dequantized by
        `dense(param, used)` (the float weights [E', N, K] of the int64 expert ids `used`)."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        # the experts that received a token, in id order: moe_experts_ref visits them in the
        # same order with the same values as it would the whole stack
        used = torch.unique(topk_ids.reshape(-1).long())
        remap = torch.zeros(layer.num_experts, dtype=torch.int64)
        remap[used] = torch.arange(used.numel())
        w13, w2 = dense("w13", used), dense("w2", used)
        moe_experts_ref = dispatch.reference("moe_experts")
        return moe_experts_ref(x, w13, w2, topk_weights, remap[topk_ids.long()])


class UnquantizedExperts(ExpertsMethod):
    """fp16/fp32 (bf16 where the device has it) experts: w13 [E, 2I, H] (each expert's gate
    rows, then its up rows: the merged gate_up layout of the dense MLP) and w2 [E, H, I]."""

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        E, H, inter = layer.num_experts, layer.hidden, layer.inter
        layer.w13 = nn.Parameter(torch.empty(E, 2 * inter, H, dtype=dtype), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(E, H, inter, dtype=dtype), requires_grad=False)

    def load(
        self, layer: FusedExperts, name: str, shard: tuple[int, int | None], t: torch.Tensor
    ) -> None:
        e, part = shard
        cut = layer.cut(part)
        if cut is not None:
            # this rank's gate/up rows, or its down columns, of the expert's intermediate dim
            t = float_local_tensor("weight", t, cut)
        target = getattr(layer, name).data[e]
        if part is not None:
            target = target.narrow(0, part * layer.inter, layer.inter)
        if tuple(t.shape) != tuple(target.shape):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(t.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.copy_(t)

    def apply(self, layer, ops, x, topk_weights, topk_ids) -> torch.Tensor:
        return ops.moe_experts(x, layer.w13, layer.w2, topk_weights, topk_ids)


def experts_method(
    quant: QuantConfig | None, prefix: str, names: str, num_experts: int
) -> ExpertsMethod:
    """The method for one layer's experts, from what the checkpoint's quantization config says
    of each expert's projections (checkpoint names, e.g. model.layers.0.mlp.experts.3.up_proj).
    Every expert of a layer must share one method: they are stored stacked."""
    quant = quant or UNQUANTIZED
    if quant is UNQUANTIZED:
        return UnquantizedExperts()
    from voltserve.services.executor.quant.group import GroupQuantMethod

    methods = {
        f"{prefix}.{e}.{leaf}": quant.method_for([f"{prefix}.{e}.{leaf}"])
        for e in range(num_experts)
        for leaf in EXPERT_NAMES[names]
    }
    if all(isinstance(m, UnquantizedMethod) for m in methods.values()):
        return UnquantizedExperts()
    first_name, first = next(iter(methods.items()))
    q_name, q = next((n, m) for n, m in methods.items() if not isinstance(m, UnquantizedMethod))
    from voltserve.services.executor.quant.fp4 import Fp4Method

    if isinstance(q, Fp4Method):
        for name, m in methods.items():
            if not (isinstance(m, Fp4Method) and m.layout == q.layout):
                raise QuantFormatError(
                    f"{name}: {m.describe()} differs from {q_name}: {q.describe()}; the experts "
                    f"of a layer are stored stacked, so they must share one FP4 format "
                    f"({quant.describe()})"
                )
        from voltserve.services.executor.quant.fp4_experts import Fp4Experts

        return Fp4Experts(q.layout, prefix)
    if not isinstance(q, GroupQuantMethod):
        raise QuantFormatError(
            f"{q_name}: {q.describe()} MoE experts are not supported (stacked experts "
            "load from the integer group-quantized formats, FP4 and GGUF)"
        )
    for name, m in methods.items():
        same = (
            isinstance(m, GroupQuantMethod)
            and isinstance(first, GroupQuantMethod)
            and m.family == first.family
        )
        if not same:
            raise QuantFormatError(
                f"{name}: {m.describe()} differs from {first_name}: {first.describe()}; the "
                "experts of a layer are stored stacked, so they must share one group-quantized "
                f"format ({quant.describe()})"
            )
    from voltserve.services.executor.quant.experts import GroupQuantExperts

    variant = "/".join(dict.fromkeys(m.variant for m in methods.values()))
    return GroupQuantExperts(first, prefix, variant)


class FusedExperts(nn.Module):
    """E experts of one layer, stored stacked per layer by its `method` (UnquantizedExperts:
    w13 [E, 2I, H] and w2 [E, H, I]). Checkpoints name each expert's projections separately;
    `checkpoint_params` maps those names to (parameter, (expert, part)) for the loader."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        names: str = "qwen",
        method: ExpertsMethod | None = None,
        tp: RowParallel | None = None,
    ) -> None:
        """tp: this rank's columns [start, start + length) of every expert's intermediate dim
        (gate/up rows column-parallel, down columns row-parallel); `inter` is the whole one.
        The partial sums are reduced by the MoE block, once."""
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.inter_full, self.tp = inter, tp
        self.inter = inter if tp is None else tp.length
        self.names = EXPERT_NAMES[names]
        self.method = method or UnquantizedExperts()
        self.method.create_weights(self, dtype)

    def cut(self, part: int | None) -> Cut | None:
        """This rank's part of one expert projection: gate/up (part 0/1) are column-parallel
        over the intermediate dim, down (None) row-parallel."""
        if self.tp is None:
            return None
        p = self.tp
        return Cut(part is not None, p.start, p.length, self.inter_full, p.group.rank == 0)

    def checkpoint_params(self) -> dict[str, tuple[str, tuple[int, int | None]]]:
        """What the loader asks: the method's checkpoint names for this layer."""
        return self.method.checkpoint_params(self)

    def load_weight(
        self, param_name: str, shard: tuple[int, int | None], tensor: torch.Tensor
    ) -> None:
        """Hand one expert's projection to the method; it raises naming the shape on a
        mismatch."""
        self.method.load(self, param_name, shard, tensor)

    def nbytes(self) -> int:
        ts = list(self.parameters()) + list(self.buffers())
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(
        self,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return self.method.apply(self, ops, x, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """A gated MLP (Qwen2-MoE's shared expert): the same parameter names as the dense MLP, so
    the loader merges gate_proj/up_proj into gate_up_proj the same way."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: RowParallel | None = None,
    ) -> None:
        """tp: this rank's slice of the intermediate dim (as a dense MLP's), its down_proj
        left unreduced: the MoE block reduces the experts and the shared expert together."""
        super().__init__()
        part = None if tp is None else (tp.start, tp.length)
        self.gate_up_proj = Linear(
            hidden,
            {0: inter, 1: inter},
            False,
            dtype,
            quant,
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            None if tp is None else ColumnParallel(tp.group, {0: part, 1: part}),
        )
        self.down_proj = Linear(
            inter, {None: hidden}, False, dtype, quant, [f"{prefix}.down_proj"], tp
        )

    def forward(self, ops: KernelDispatch, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(x, self.gate_up_proj, ops), ops)


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared expert): [T, H] -> [T, H]. `prefix` is the block's
    checkpoint name (model.layers.N.mlp; Mixtral's model.layers.N.block_sparse_moe): its
    linears carry checkpoint names, so `quant` picks the shared expert's methods as for a dense
    MLP, and the experts' method (experts_method) from what it says of each expert."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        inter: int,
        renormalize: bool,
        dtype: torch.dtype,
        weights_in_dtype: bool = True,
        shared_inter: int = 0,
        names: str = "qwen",
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
    ) -> None:
        """tp / lay: this rank's group and its slices of the experts' and the shared expert's
        intermediate dims (TPLayout); the router and the shared expert's gate are replicated."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts {num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        # The Qwen routers hand the experts their weights in the activation dtype; Mixtral's
        # stay fp32.
        self.weights_dtype = dtype if weights_in_dtype else None
        # The router and the shared expert's gate stay float whatever the config says: every
        # quantizer keeps them so (they are tiny and routing is sensitive to them).
        self.gate = Linear(hidden, {None: num_experts}, False, dtype, None, [f"{prefix}.gate"])
        self.tp = tp
        # One all-reduce per block, after the weighted sum of the experts' (and the shared
        # expert's) partial products: each rank holds a slice of every expert's intermediate.
        row = None if tp is None else RowParallel(tp, lay.moe_inter_start, lay.moe_inter_size)
        shared_row = (
            None
            if tp is None or not shared_inter
            else RowParallel(tp, lay.shared_inter_start, lay.shared_inter_size, reduce=False)
        )
        method = experts_method(quant, f"{prefix}.experts", names, num_experts)
        self.experts = FusedExperts(num_experts, hidden, inter, dtype, names, method, row)
        self.shared_expert = (
            SharedExpert(hidden, shared_inter, dtype, quant, f"{prefix}.shared_expert", shared_row)
            if shared_inter
            else None
        )
        self.shared_expert_gate = (
            Linear(hidden, {None: 1}, False, dtype, None, [f"{prefix}.shared_expert_gate"])
            if shared_inter
            else None
        )

    @classmethod
    def from_arch(
        cls,
        arch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
    ) -> SparseMoE:
        """The MoE block of a ModelArch (models/llama.py) with num_experts > 0."""
        mixtral = arch.moe_family == "mixtral"
        return cls(
            arch.hidden_size,
            arch.num_experts,
            arch.num_experts_per_tok,
            arch.moe_intermediate_size,
            renormalize=mixtral or arch.norm_topk_prob,
            dtype=dtype,
            weights_in_dtype=not mixtral,
            shared_inter=arch.shared_expert_intermediate_size,
            names=arch.moe_family,
            quant=quant,
            prefix=prefix,
            tp=tp,
            lay=lay,
        )

    def forward(self, ops: KernelDispatch, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x, ops)
        weights, ids = ops.moe_topk(logits, self.top_k, self.renormalize, self.weights_dtype)
        out = self.experts(ops, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, x)
            out = out + torch.sigmoid(self.shared_expert_gate(x, ops)) * shared
        return out if self.tp is None else self.tp.all_reduce(out)


__all__ = [
    "EXPERT_NAMES",
    "ExpertsMethod",
    "FusedExperts",
    "SharedExpert",
    "SparseMoE",
    "UnquantizedExperts",
    "experts_method",
]
