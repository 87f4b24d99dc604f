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

Quantization seam: `FusedExperts` is to the experts what `layers.Linear` is to a linear. It
creates the stacked parameters, loads each checkpoint tensor into its expert's slice through
`load_weight(param_name, (expert, part), tensor)` and multiplies through `ops.moe_experts`. A
quantized method subclasses it: it declares its own stacked parameters (e.g. qweight
[E, 2I, H/8] int32, scales/zeros [E, 2I, H/group]), converts each expert's tensors into its slot
at load (the repacking for the kernel happens once, there), lists the checkpoint names it needs
in `checkpoint_params`, and overrides `forward` to call its grouped/decode kernels with the same
routing tensors. The model and the loader stay the same.
"""

from __future__ import annotations

import torch
from torch import nn
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import Linear, gate_up_silu

# Per family: the checkpoint leaf name of each expert projection -> (our parameter, part):
# part 0 = gate rows of w13, 1 = up rows of w13, None = w2.
EXPERT_NAMES = {
    "qwen": {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)},
    "mixtral": {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)},
}


class FusedExperts(nn.Module):
    """E experts of one layer, stacked: w13 [E, 2I, H] (gate rows then up rows per expert, the
    merged gate_up layout) and w2 [E, H, I]."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, names: str = "qwen"
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.names = EXPERT_NAMES[names]
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False
        )

    def checkpoint_params(self) -> dict[str, tuple[str, tuple[int, int | None]]]:
        """Checkpoint name relative to this module -> (parameter, (expert, part))."""
        out = {}
        for e in range(self.num_experts):
            for leaf, (param, part) in self.names.items():
                out[f"{e}.{leaf}.weight"] = (param, (e, part))
        return out

    def load_weight(
        self, param_name: str, shard: tuple[int, int | None], tensor: torch.Tensor
    ) -> None:
        """Copy one expert's projection into its slice; raise naming the shape on a mismatch."""
        e, part = shard
        param = getattr(self, param_name)
        target = param.data[e]
        if part is not None:
            target = target.narrow(0, part * self.inter, self.inter)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(
        self,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return ops.moe_experts(x, self.w13, self.w2, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """A gated MLP (Qwen2-MoE's shared expert): the same parameter names as the dense MLP, so
    the loader merges gate_proj/up_proj into gate_up_proj the same way."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, {0: inter, 1: inter}, False, dtype)
        self.down_proj = Linear(inter, {None: hidden}, False, dtype)

    def forward(self, ops: KernelDispatch, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(x, self.gate_up_proj, ops), ops)


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared expert): [T, H] -> [T, H]."""

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
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts {num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        # The Qwen routers hand the experts their weights in the activation dtype; Mixtral's
        # stay fp32.
        self.weights_dtype = dtype if weights_in_dtype else None
        self.gate = Linear(hidden, {None: num_experts}, False, dtype)
        self.experts = FusedExperts(num_experts, hidden, inter, dtype, names)
        self.shared_expert = SharedExpert(hidden, shared_inter, dtype) if shared_inter else None
        self.shared_expert_gate = Linear(hidden, {None: 1}, False, dtype) if shared_inter else None

    @classmethod
    def from_arch(cls, arch, dtype: torch.dtype) -> SparseMoE:
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
        )

    def forward(self, ops: KernelDispatch, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x, ops)
        weights, ids = ops.moe_topk(logits, self.top_k, self.renormalize, self.weights_dtype)
        out = self.experts(ops, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, x)
            out = out + torch.sigmoid(self.shared_expert_gate(x, ops)) * shared
        return out


__all__ = ["FusedExperts", "SharedExpert", "SparseMoE", "EXPERT_NAMES"]
