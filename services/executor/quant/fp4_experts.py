"""FP4 MoE experts (compressed-tensors nvfp4- / mxfp4-pack-quantized, ModelOpt NVFP4): the experts'
side of the quantization seam (models/moe.py `ExpertsMethod`) for the formats of quant/fp4.py.

Checkpoints store each expert's projections as separate FP4 linears
(model.layers.N.mlp.experts.E.gate_proj.weight_packed / .weight_scale / .weight_global_scale,
ModelOpt's .weight / .weight_scale / .weight_scale_2). Each one is checked and unpacked as a
dense FP4 linear's shard is (fp4.unpack_shard), gate and up are merged along N, and every expert
is dequantized once at load (kernels/linear/fp4_pack.dequantize_fp4: computed in fp32, rounded
once to the run dtype) into the float experts' stacked layout, w13 [E, 2I, H] and w2 [E, H, I].
The float experts' kernels (ops.moe_experts) run them, on CPU and CUDA alike: there is no fused
FP4 expert kernel, so the experts take the run dtype's bytes in memory (4x the FP4 codes for
fp16), which the loader says once in its log. The activation scales some checkpoints carry are
read and dropped (weights only), as for the dense FP4 linears.

Tensor parallelism: each expert projection narrows by the FP4 shard rule (fp4.split: gate/up
along the outputs, down along the inputs by whole blocks), so each rank dequantizes its slice of
every expert.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from voltserve.kernels.linear.fp4_pack import concat_rows, dequantize_fp4
from voltserve.services.executor.models.moe import FusedExperts, UnquantizedExperts
from voltserve.services.executor.quant.fp4 import (
    Fp4Layout,
    note_activation_scales_ignored,
    split,
    unpack_shard,
)
from voltserve.shared.logging import warn_once

logger = logging.getLogger(__name__)


def _note_dequantized(variant: str) -> None:
    warn_once(
        logger,
        "fp4_experts.dequantized",
        "%s MoE experts are dequantized at load to the run dtype (no fused FP4 expert "
        "kernel): they take the float experts' memory and speed, not FP4's",
        variant,
    )


class Fp4Experts(UnquantizedExperts):
    """Stacked experts dequantized from their FP4 projections at load; `layout` is the one the
    config gives every expert projection of the layer."""

    def __init__(self, layout: Fp4Layout, prefix: str) -> None:
        self.layout, self.prefix = layout, prefix
        self.variant = layout.variant

    def describe(self) -> str:
        return f"{self.variant} experts (dequantized at load)"

    def create_weights(self, layer: FusedExperts, dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)
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
        H, inter = layer.hidden, layer.inter
        dev, dtype = layer.w13.device, layer.w13.dtype
        shapes = {"w13": (inter, H), "w2": (H, inter)}  # per part: (rows, in_features)
        for e in range(layer.num_experts):
            for param, parts in (("w13", (0, 1)), ("w2", (None,))):
                # checked and unpacked where loaded (the host), dequantized on the device
                ws = [
                    unpack_shard(
                        layer.staged.pop((e, part)),
                        self._name(layer, e, part),
                        *shapes[param],
                        self.layout,
                    )
                    for part in parts
                ]
                w = ws[0] if len(ws) == 1 else concat_rows(ws)
                w = replace(
                    w, packed=w.packed.to(dev), scales=w.scales.to(dev), gscale=w.gscale.to(dev)
                )
                getattr(layer, param).data[e].copy_(dequantize_fp4(w, dtype))
        del layer.staged
        _note_dequantized(self.variant)


__all__ = ["Fp4Experts"]
