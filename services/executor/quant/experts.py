"""Group-quantized MoE experts (AWQ, GPTQ, compressed-tensors int4/int8): the experts' side of
the quantization seam (models/moe.py `ExpertsMethod`).

Checkpoints store each expert's projections as separate quantized linears
(model.layers.N.mlp.experts.E.gate_proj.qweight / .scales / .qzeros ...). Each one is unpacked
by the format's `GroupQuantMethod.unpack` into codes / scales / offsets (the linear path's
ShardCodes), gate and up are merged along N as for a dense gate_up_proj, every expert is packed
once with kernels/quant_pack.pack_group_quant, and the packed tensors are stacked per layer:

    w13_qweight [E, 2I, H / P] int32, w13_scales / w13_offsets [E, 2I, H / g] (run dtype)
    w2_qweight  [E, H,  I / P] int32, w2_scales  / w2_offsets  [E, H,  I / g]
    (+ w13_perm [E, H] / w2_perm [E, I] int64 for GPTQ act-order)

`apply` is the torch reference: it dequantizes experts (kernels/quant_pack.dequantize's rule,
rounded once to the run dtype) and runs the float experts path. On CPU it dequantizes only the
experts that received a token (syncs with the host); on CUDA every expert of the layer, so the
step has no host sync and a CUDA graph can hold it, then the float expert kernels
(ops.moe_experts). No fused int4 expert kernel yet: this is the correctness path, not the fast
one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from voltserve.kernels.quant_pack import GroupQuantWeight, dequantize, pack_group_quant
from voltserve.services.executor.models.moe import ExpertsMethod, FusedExperts
from voltserve.services.executor.quant.group import GroupQuantMethod, merge_shards

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch

# our stacked weight -> its parts in order (part index of EXPERT_NAMES; None: the whole of w2)
_PARTS = {"w13": (0, 1), "w2": (None,)}


class GroupQuantExperts(ExpertsMethod):
    """Stacked group-quantized experts; `linear` is the method the config gives each expert
    projection (its tensor names and its format's unpack)."""

    def __init__(self, linear: GroupQuantMethod, prefix: str) -> None:
        self.linear, self.prefix = linear, prefix

    def describe(self) -> str:
        return f"{self.linear.variant} experts"

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer.staged = {}  # (param, expert, part) -> {tensor name: tensor}
        layer.quant_weights = {}  # "w13" / "w2" -> per-expert GroupQuantWeight views

    def _leaf(self, layer: FusedExperts, param: str, part: int | None) -> str:
        return next(leaf for leaf, pp in layer.names.items() if pp == (param, part))

    def checkpoint_params(self, layer: FusedExperts) -> dict:
        out = {}
        for e in range(layer.num_experts):
            for leaf, (_param, part) in layer.names.items():
                for t in self.linear.required + self.linear.optional:
                    out[f"{e}.{leaf}.{t}"] = (t, (e, part))
        return out

    def optional_checkpoint_params(self, layer: FusedExperts) -> set[str]:
        return {
            f"{e}.{leaf}.{t}"
            for e in range(layer.num_experts)
            for leaf in layer.names
            for t in self.linear.optional
        }

    def load(self, layer: FusedExperts, name: str, shard: tuple, t: torch.Tensor) -> None:
        e, part = shard
        if name not in self.linear.required and name not in self.linear.optional:
            raise KeyError(f"{self.linear.variant} experts have no tensor {name!r}")
        layer.staged.setdefault((e, part), {})[name] = t

    def process_after_loading(self, layer: FusedExperts) -> None:
        E, H, inter, dev = layer.num_experts, layer.hidden, layer.inter, self.device
        shapes = {"w13": (inter, H), "w2": (H, inter)}  # per part: (rows, in_features)
        for param, parts in _PARTS.items():
            packed: list[GroupQuantWeight] = []
            for e in range(E):
                codes, names = [], []
                for part in parts:
                    name = f"{self.prefix}.{e}.{self._leaf(layer, param, part)}"
                    staged = {k: v.to(dev) for k, v in layer.staged.pop((e, part), {}).items()}
                    rows, k = shapes[param]
                    codes.append(self.linear.unpack(staged, name, rows, k))
                    names.append(name)
                m = merge_shards(codes, names)
                try:
                    packed.append(
                        pack_group_quant(
                            m.codes.to(dev),
                            m.scales.to(dev),
                            m.offsets.to(dev),
                            m.bits,
                            m.group_size,
                            self.dtype,
                            None if m.perm is None else m.perm.to(dev),
                        )
                    )
                except ValueError as err:
                    raise ValueError(f"{names[0]}: {self.linear.variant}: {err}") from err
                w0 = packed[0]
                if (packed[-1].bits, packed[-1].group_size) != (w0.bits, w0.group_size) or (
                    (packed[-1].perm is None) != (w0.perm is None)
                ):
                    raise ValueError(
                        f"{names[0]}: {self.linear.variant}: bits, group size or act-order "
                        f"differ from expert 0's (the experts of a layer are stored stacked)"
                    )
            self._stack(layer, param, packed)
        del layer.staged

    def _stack(self, layer: FusedExperts, param: str, packed: list[GroupQuantWeight]) -> None:
        """One [E, ...] tensor per field (buffers of the layer), and per-expert views of it."""
        fields = ["qweight", "scales", "offsets"] + (["perm"] if packed[0].perm is not None else [])
        stacked = {f: torch.stack([getattr(w, f) for w in packed]).contiguous() for f in fields}
        for f, t in stacked.items():
            layer.register_buffer(f"{param}_{f}", t, persistent=False)
        layer.quant_weights[param] = [
            replace(w, **{f: stacked[f][e] for f in fields}) for e, w in enumerate(packed)
        ]

    def dense_expert(self, layer: FusedExperts, param: str, e: int) -> torch.Tensor:
        """Expert e's float weight in the checkpoint's input order, in the run dtype."""
        w = layer.quant_weights[param][e]
        deq = dequantize(w)
        if w.perm is None:
            return deq
        out = torch.empty_like(deq)
        out[:, w.perm] = deq  # y = x[:, perm] @ deq^T = x @ out^T
        return out

    def dense_all(self, layer: FusedExperts, param: str) -> torch.Tensor:
        """Every expert's float weight [E, N, K] (checkpoint input order) from the stacked
        tensors in one dequantize, with no host sync."""
        ws = layer.quant_weights[param]
        w0, E = ws[0], len(ws)
        N, K = w0.out_features, w0.in_features

        def flat(f: str) -> torch.Tensor:
            return getattr(layer, f"{param}_{f}").view(E * N, -1)

        whole = replace(
            w0,
            out_features=E * N,
            qweight=flat("qweight"),
            scales=flat("scales"),
            offsets=flat("offsets"),
            perm=None,
        )
        deq = dequantize(whole).view(E, N, K)
        if w0.perm is None:
            return deq
        perm = getattr(layer, f"{param}_perm")  # [E, K]
        return torch.empty_like(deq).scatter_(2, perm[:, None, :].expand(E, N, K), deq)

    def apply(
        self,
        layer: FusedExperts,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        from voltserve.kernels.moe_experts import moe_experts_ref

        if x.is_cuda:
            # every expert: no host sync (graph-capturable); the float kernels run the product
            w13, w2 = self.dense_all(layer, "w13"), self.dense_all(layer, "w2")
            return ops.moe_experts(x, w13, w2, topk_weights, topk_ids)
        used = torch.unique(topk_ids.reshape(-1).long())
        remap = torch.zeros(layer.num_experts, dtype=torch.int64)
        remap[used] = torch.arange(used.numel())
        ids = used.tolist()
        w13 = torch.stack([self.dense_expert(layer, "w13", e) for e in ids])
        w2 = torch.stack([self.dense_expert(layer, "w2", e) for e in ids])
        return moe_experts_ref(x, w13, w2, topk_weights, remap[topk_ids.long()])


__all__ = ["GroupQuantExperts"]
