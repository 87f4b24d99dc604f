"""FP4 MoE experts (compressed-tensors nvfp4- / mxfp4-pack-quantized, ModelOpt NVFP4): the experts'
side of the quantization seam (models/moe.py `ExpertsMethod`) for the formats of quant/fp4.py.

Checkpoints store each expert's projections as separate FP4 linears
(model.layers.N.mlp.experts.E.gate_proj.weight_packed / .weight_scale / .weight_global_scale,
ModelOpt's .weight / .weight_scale / .weight_scale_2). Each one is checked and unpacked as a
dense FP4 linear's shard is (fp4.unpack_shard), gate and up are merged along N, and the packed
experts are stacked per layer as they were read (kernels/linear/fp4_pack.py's layout, nothing
dequantized at load):

    w13_packed [E, 2I, H / 2] uint8, w13_scales [E, 2I, H / g] uint8, w13_gscale [E, 2I] fp32
    w2_packed  [E, H,  I / 2] uint8, w2_scales  [E, H,  I / g] uint8, w2_gscale  [E, H]  fp32

so the experts hold 4.5 (NVFP4) or 4.25 (MXFP4) bits a weight plus 4 bytes a row.

`apply`: on CUDA, decode batches (kernels/moe/quant_decode.fused_pays: up to 8 tokens, more
while the routed pairs read fewer bytes than the alternative) run the fused FP4 expert kernels
(kernels/moe/fp4_decode.py), behind the fp16 experts' switch (impl["moe_experts"] == "cuda").
Larger batches dequantize every expert of the layer once per call (the FP4 dequantize kernel),
then run the float expert kernels (ops.moe_experts), with no host sync, so a CUDA graph can hold
either. That float copy is one layer's, transient: the caching allocator hands the same blocks to
the next layer, so the peak adds one layer's float experts (Qwen3-30B-A3B in fp16: 1.1 GiB), not
the whole model's (48 layers: 54 GiB, what dequantizing at load took), and the start-up profile
that sizes the KV cache sees it. Per-expert chunks would shrink that transient further but run
the grouped GEMMs once per chunk over the whole batch; prefill amortises one dequantize over
its tokens. On CPU the experts that received a token are dequantized (fp4_pack.dequantize_fp4,
rounded once to the run dtype) and moe_experts_ref runs on them: the same values, in the same
order, as dequantizing every expert, so the CPU output is the float experts' reference exactly.
The activation scales some checkpoints carry are read and dropped (weights only), as for the
dense FP4 linears.

Tensor parallelism: each expert projection narrows by the FP4 shard rule (fp4.split: gate/up
along the outputs, down along the inputs by whole blocks), so each rank stacks its slice of
every expert.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import dispatch
from voltserve.kernels.linear.fp4_pack import Fp4Weight, concat_rows
from voltserve.services.executor.models.moe import ExpertsMethod, FusedExperts
from voltserve.services.executor.quant.fp4 import (
    Fp4Layout,
    note_activation_scales_ignored,
    split,
    unpack_shard,
)
from voltserve.shared.logging import log_once

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch

logger = logging.getLogger(__name__)
_FIELDS = ("packed", "scales", "gscale")
_PARTS = {"w13": (0, 1), "w2": (None,)}  # our stacked weight -> its parts (EXPERT_NAMES)


def _note_packed(variant: str, layer: FusedExperts, dtype: torch.dtype) -> None:
    mib = 2**20
    floats = layer.num_experts * 3 * layer.hidden * layer.inter * dtype.itemsize
    log_once(
        logger,
        logging.INFO,
        "fp4_experts.packed",
        "%s MoE experts stay packed: %.1f MiB a layer (%.1f MiB as %s); decode batches run "
        "the fused FP4 expert kernels on CUDA, larger ones dequantize one layer's experts "
        "at a time (a transient of the float size)",
        variant,
        layer.nbytes() / mib,
        floats / mib,
        str(dtype).removeprefix("torch."),
    )


class Fp4Experts(ExpertsMethod):
    """Stacked packed FP4 experts; `layout` is the one the config gives every expert projection
    of the layer."""

    def __init__(self, layout: Fp4Layout, prefix: str) -> None:
        self.layout, self.prefix = layout, prefix
        self.variant = layout.variant

    def describe(self) -> str:
        return f"{self.variant} experts"

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer.staged = {}  # (expert, part) -> {tensor name: tensor}

    def checkpoint_params(self, layer: FusedExperts) -> dict:
        names = self.layout.required() + list(self.layout.activation_scales)
        return {
            f"{e}.{leaf}.{t}": (t, (e, part))
            for e in range(layer.num_experts)
            for leaf, (_param, part) in layer.names.items()
            for t in names
        }

    def optional_checkpoint_params(self, layer: FusedExperts) -> set[str]:
        return {
            f"{e}.{leaf}.{t}"
            for e in range(layer.num_experts)
            for leaf in layer.names
            for t in self.layout.activation_scales
        }

    def _name(self, layer: FusedExperts, e: int, part: int | None) -> str:
        param = "w2" if part is None else "w13"
        leaf = next(leaf for leaf, pp in layer.names.items() if pp == (param, part))
        return f"{self.prefix}.{e}.{leaf}"

    def load(self, layer: FusedExperts, name: str, shard: tuple, t: torch.Tensor) -> None:
        e, part = shard
        if name in self.layout.activation_scales:
            note_activation_scales_ignored(self.variant)
            return
        if name not in self.layout.required():
            raise KeyError(f"{self.variant} experts have no tensor {name!r}")
        cut = layer.cut(part)
        if cut is not None:
            # the FP4 shard rule, as for a dense gate_up (column) / down (row) linear
            prefix = self._name(layer, e, part)
            t = split(self.layout, name).narrow(t, cut, f"{prefix}.{name}")
        layer.staged.setdefault((e, part), {})[name] = t

    def process_after_loading(self, layer: FusedExperts) -> None:
        E, H, inter, dev = layer.num_experts, layer.hidden, layer.inter, self.device
        g = self.layout.group
        shapes = {"w13": (inter, H), "w2": (H, inter)}  # per part: (rows, in_features)
        for param, parts in _PARTS.items():
            rows, k = shapes[param]
            n = rows * len(parts)
            stacked = {
                "packed": torch.empty(E, n, k // 2, dtype=torch.uint8, device=dev),
                "scales": torch.empty(E, n, k // g, dtype=torch.uint8, device=dev),
                "gscale": torch.empty(E, n, dtype=torch.float32, device=dev),
            }
            for e in range(E):
                # checked and unpacked where loaded (the host), then copied to the device
                ws = [
                    unpack_shard(
                        layer.staged.pop((e, part)),
                        self._name(layer, e, part),
                        rows,
                        k,
                        self.layout,
                    )
                    for part in parts
                ]
                w = ws[0] if len(ws) == 1 else concat_rows(ws)
                for f in _FIELDS:
                    stacked[f][e].copy_(getattr(w, f))
            for f, t in stacked.items():
                layer.register_buffer(f"{param}_{f}", t, persistent=False)
        del layer.staged
        _note_packed(self.variant, layer, self.dtype)

    def flat(self, layer: FusedExperts, param: str, experts: torch.Tensor | None = None):
        """The stacked experts of `param` ("w13" / "w2") as one flat Fp4Weight [E' * N, K]:
        views of the layer's buffers, or of `experts`' rows (int64 ids) when given."""

        def pick(f: str) -> torch.Tensor:
            t = getattr(layer, f"{param}_{f}")
            return t if experts is None else t.index_select(0, experts)

        return dispatch.fp4_experts_flat(
            *(pick(f) for f in _FIELDS), self.layout.group, self.layout.scale_kind
        )

    def dense(
        self,
        layer: FusedExperts,
        param: str,
        experts: torch.Tensor | None = None,
        kernel: bool = False,
    ) -> torch.Tensor:
        """The float weights [E', N, K] of `experts` (int64 ids; None: all E) in the run dtype,
        in one dequantize (kernel: on CUDA, the FP4 dequantize kernel where it takes them)."""
        w: Fp4Weight = self.flat(layer, param, experts)
        E = layer.num_experts if experts is None else experts.numel()
        out = dispatch.fp4_dequantize(w, self.dtype, kernel)
        return out.view(E, -1, w.in_features)

    def apply(
        self,
        layer: FusedExperts,
        ops: KernelDispatch,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if x.is_cuda:
            # No host sync (graph-capturable): the fused kernels for the steps they take, else
            # every expert of the layer dequantized once, then the float kernels.
            w13, w2 = self.flat(layer, "w13"), self.flat(layer, "w2")
            out = dispatch.fp4_experts_decode(ops, x, w13, w2, topk_weights, topk_ids)
            if out is not None:
                return out
            kernel = ops.impl.get("moe_experts") == "cuda"
            d13 = self.dense(layer, "w13", kernel=kernel)
            d2 = self.dense(layer, "w2", kernel=kernel)
            return ops.moe_experts(x, d13, d2, topk_weights, topk_ids)
        return self.reference_on_used_experts(
            layer, x, topk_weights, topk_ids, lambda param, used: self.dense(layer, param, used)
        )


__all__ = ["Fp4Experts"]
