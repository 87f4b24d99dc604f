"""Group-quantized MoE experts (AWQ, GPTQ, compressed-tensors int4/int8, GGUF block types): the
experts' side of the quantization seam (models/moe.py `ExpertsMethod`).

Checkpoints store each expert's projections as separate quantized linears
(model.layers.N.mlp.experts.E.gate_proj.qweight / .scales / .qzeros ...; a GGUF file's stacked
expert tensors reach here split per expert, services/executor/gguf_source.py, and may give
gate/up and down different ggml types). Each one is unpacked
by the format's `GroupQuantMethod.unpack` into codes / scales / offsets (the linear path's
ShardCodes), gate and up are merged along N as for a dense gate_up_proj, every expert is packed
once with kernels/linear/quant_pack.pack_group_quant, and the packed tensors are stacked per layer:

    w13_qweight [E, 2I, H / P] int32, w13_scales / w13_offsets [E, 2I, H / g] (run dtype)
    w2_qweight  [E, H,  I / P] int32, w2_scales  / w2_offsets  [E, H,  I / g]
    (+ w13_perm [E, H] / w2_perm [E, I] int64 for GPTQ act-order)

`apply` is the torch reference: it dequantizes experts (kernels/linear/quant_pack.dequantize's rule,
rounded once to the run dtype) and runs the float experts path. On CPU it dequantizes only the
experts that received a token (syncs with the host). On CUDA nothing syncs, so a CUDA graph can
hold the step: with fewer (token, slot) pairs than experts (decode), one dequantized expert per
pair and batched matmuls (`apply_pairs`); otherwise every expert of the layer once, then the
float expert kernels (ops.moe_experts). Decode batches of at most 8 tokens run the fused
kernels of kernels/moe/quant_decode.py instead (the routed experts' codes read and dequantized
in registers), when the dispatch runs the fp16 experts' kernels (impl["moe_experts"] == "cuda")
and the experts are not act-order; the dequantizing paths stay for prefill and for the rest.

Tensor parallelism: each expert projection narrows by its format's shard rule (gate/up along
the outputs, down along the inputs: FusedExperts.cut) and unpacks as a dense linear's shard
does (group.unpack_local), so each rank stacks its slice of every expert.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import dispatch
from voltserve.kernels.linear.quant_pack import GroupQuantWeight, pack_group_quant
from voltserve.services.executor.models.moe import ExpertsMethod, FusedExperts
from voltserve.services.executor.quant.group import GroupQuantMethod, merge_shards, unpack_local
from voltserve.services.executor.tp.sharding import TPSplitError

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch

# our stacked weight -> its parts in order (part index of EXPERT_NAMES; None: the whole of w2)
_PARTS = {"w13": (0, 1), "w2": (None,)}


class GroupQuantExperts(ExpertsMethod):
    """Stacked group-quantized experts; `linear` is the method the config gives each expert
    projection (its tensor names and its format's unpack)."""

    def __init__(self, linear: GroupQuantMethod, prefix: str, variant: str | None = None) -> None:
        self.linear, self.prefix = linear, prefix
        # every variant of the layer's expert projections (one family: GroupQuantMethod.family)
        self.variant = variant or linear.variant

    def describe(self) -> str:
        return f"{self.variant} experts"

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer.staged = {}  # (param, expert, part) -> {tensor name: tensor}
        layer.quant_weights = {}  # "w13" / "w2" -> per-expert GroupQuantWeight views
        # (w13, w2) as flat [E * N, K] weights for the fused decode kernels, made on first use;
        # () where they do not serve the layer (act-order)
        layer.flat_weights = None

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
            raise KeyError(f"{self.variant} experts have no tensor {name!r}")
        cut = layer.cut(part)
        if cut is not None:
            # the format's shard rule, as for a dense gate_up (column) / down (row) linear
            prefix = self._name(layer, e, part)
            t = self.linear.split(name, prefix).narrow(t, cut, f"{prefix}.{name}")
        layer.staged.setdefault((e, part), {})[name] = t

    def _name(self, layer: FusedExperts, e: int, part: int | None) -> str:
        param = "w2" if part is None else "w13"
        return f"{self.prefix}.{e}.{self._leaf(layer, param, part)}"

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
                    sc = unpack_local(
                        self.linear, staged, name, rows, k, layer.cut(part), self.dtype
                    )
                    if isinstance(sc, torch.Tensor):
                        cut = layer.cut(part)
                        raise TPSplitError(
                            f"{name}: {self.linear.variant} act-order groups of the "
                            f"tensor-parallel input slice [{cut.start}, {cut.start + cut.length})"
                            f" of K={cut.full} are not multiples of 16 columns, which the "
                            "stacked experts need; use a smaller --tensor-parallel-size"
                        )
                    codes.append(sc)
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
                    raise ValueError(f"{names[0]}: {self.variant}: {err}") from err
                w0 = packed[0]
                if (packed[-1].bits, packed[-1].group_size) != (w0.bits, w0.group_size) or (
                    (packed[-1].perm is None) != (w0.perm is None)
                ):
                    raise ValueError(
                        f"{names[0]}: {self.variant}: bits, group size or act-order "
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
        deq = dispatch.dequantize(w, kernel=False)
        if w.perm is None:
            return deq
        out = torch.empty_like(deq)
        out[:, w.perm] = deq  # y = x[:, perm] @ deq^T = x @ out^T
        return out

    def dense_all(
        self,
        layer: FusedExperts,
        param: str,
        experts: torch.Tensor | None = None,
        kernel: bool = False,
    ) -> torch.Tensor:
        """The float weights [E', N, K] (checkpoint input order) of `experts` (int64 ids, may
        repeat; None: all E) from the stacked tensors in one dequantize, with no host sync.
        kernel: on CUDA, kernels/linear/quant_dequant's one-pass kernel where it takes the weight
        (the torch reference's fp32 temporaries took ~15 ms a layer for Qwen3-30B-A3B's experts)."""
        ws = layer.quant_weights[param]
        w0 = ws[0]
        N, K = w0.out_features, w0.in_features
        E = len(ws) if experts is None else experts.numel()

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if experts is None else t.index_select(0, experts)

        def flat(f: str) -> torch.Tensor:
            return pick(getattr(layer, f"{param}_{f}")).reshape(E * N, -1)

        whole = replace(
            w0,
            out_features=E * N,
            qweight=flat("qweight"),
            scales=flat("scales"),
            offsets=flat("offsets"),
            perm=None,
        )
        deq = dispatch.dequantize(whole, kernel).view(E, N, K)
        if w0.perm is None:
            return deq
        perm = pick(getattr(layer, f"{param}_perm"))  # [E', K]
        return torch.empty_like(deq).scatter_(2, perm[:, None, :].expand(E, N, K), deq)

    def apply(
        self,
        layer: FusedExperts,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if x.is_cuda:
            # No host sync (graph-capturable). Decode batches the fused kernels take (behind the
            # fp16 experts' switch, ops.impl["moe_experts"]) read the routed experts' codes;
            # else, fewer (token, expert) pairs than experts: dequantize each pair's expert;
            # else every expert once, then the float kernels.
            fused = self._fused(layer, ops, x, topk_ids)
            if fused is not None:
                return fused(x, *layer.flat_weights, topk_weights, topk_ids)
            if topk_ids.numel() < layer.num_experts:
                return self.apply_pairs(layer, x, topk_weights, topk_ids)
            kernel = ops.impl.get("moe_experts") == "cuda"
            w13 = self.dense_all(layer, "w13", kernel=kernel)
            w2 = self.dense_all(layer, "w2", kernel=kernel)
            return ops.moe_experts(x, w13, w2, topk_weights, topk_ids)
        return self.reference_on_used_experts(
            layer,
            x,
            topk_weights,
            topk_ids,
            lambda param, used: torch.stack(
                [self.dense_expert(layer, param, e) for e in used.tolist()]
            ),
        )

    def _fused(self, layer: FusedExperts, ops, x: torch.Tensor, topk_ids: torch.Tensor):
        """kernels/moe/quant_decode's launcher when it serves this step, else None."""
        k = topk_ids.shape[1]
        launcher = dispatch.quant_experts_decode(ops, x, k, layer.num_experts)
        if launcher is None:
            return None
        if layer.flat_weights is None:
            w13, w2 = (layer.quant_weights[p][0] for p in ("w13", "w2"))
            if w13.perm is not None or w2.perm is not None:
                layer.flat_weights = ()  # act-order: a permutation per expert, not served
            else:
                layer.flat_weights = tuple(
                    dispatch.quant_experts_flat(
                        getattr(layer, f"{p}_qweight"),
                        getattr(layer, f"{p}_scales"),
                        getattr(layer, f"{p}_offsets"),
                        w,
                    )
                    for p, w in (("w13", w13), ("w2", w2))
                )
        if not layer.flat_weights or not dispatch.quant_experts_take(x, *layer.flat_weights, k):
            return None
        return launcher

    def apply_pairs(
        self,
        layer: FusedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """moe_experts_ref's products with one dequantized expert per (token, slot) pair, as
        batched matmuls (no host sync: every shape follows from T and k)."""
        silu_and_mul_ref = dispatch.reference("silu_and_mul")
        T, k = topk_ids.shape
        # The router never yields an id outside 0..E-1; the clamp is for the start-up trace
        # (services/executor/kernel_warmup.py records the router kernel without running it, so
        # the ids are uninitialised memory and an unclamped gather could fault).
        ids = topk_ids.reshape(-1).long().clamp(0, layer.num_experts - 1)
        w13 = self.dense_all(layer, "w13", ids)  # [P, 2I, H]
        w2 = self.dense_all(layer, "w2", ids)  # [P, H, I]
        xs = x.repeat_interleave(k, dim=0)  # pair p = token p // k
        h = silu_and_mul_ref(torch.bmm(w13, xs.unsqueeze(-1)).squeeze(-1))
        y = torch.bmm(w2.float(), h.float().unsqueeze(-1)).squeeze(-1)  # [P, H] fp32
        y = y * topk_weights.reshape(-1, 1).float()
        return y.view(T, k, -1).sum(1).to(x.dtype)


__all__ = ["GroupQuantExperts"]
