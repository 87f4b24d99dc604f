"""The linear method of the FP4 formats (compressed-tensors nvfp4- / mxfp4-pack-quantized, ModelOpt
NVFP4): each shard's checkpoint tensors are kept as loaded, checked and turned into one packed
`Fp4Weight` (kernels/linear/fp4_pack.py: codes and scale bytes as stored, a global fp32
multiplier per row), reached through kernels/dispatch.fp4_linear.

Weights only: the activations stay in the run dtype. The activation scales some checkpoints
carry (compressed-tensors `input_global_scale`, ModelOpt `input_scale`, for W4A4 kernels that
quantize x to FP4) are read and dropped; the loader says so once in its log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from voltserve.kernels import dispatch
from voltserve.kernels.linear.fp4_pack import (
    E4M3,
    E8M0,
    Fp4Weight,
    check_scale_bytes,
    concat_rows,
    make_fp4_weight,
)
from voltserve.services.executor.quant.base import Shard
from voltserve.services.executor.quant.staged import (
    StagedMethod,
    check_shape,
    on_rows,
    staged_shards,
)
from voltserve.services.executor.tp.sharding import TensorSplit
from voltserve.shared.logging import warn_once

if TYPE_CHECKING:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear

logger = logging.getLogger(__name__)


def note_activation_scales_ignored(where: str) -> None:
    """Logs once per process that FP4 activation quantization is not applied."""
    warn_once(
        logger,
        "fp4.activation_scales_ignored",
        "%s: the checkpoint's FP4 activation quantization (input scales) is ignored: "
        "weights are served as FP4, activations stay in the run dtype (fp16)",
        where,
    )


@dataclass(frozen=True)
class Fp4Layout:
    """How one checkpoint format names and stores an FP4 linear."""

    variant: str  # for logs and errors, e.g. "compressed-tensors NVFP4 g16"
    codes: str  # the packed uint8 codes [N, K / 2]
    scale: str  # the block scales [N, K / g]
    scale_kind: str  # E4M3 (float8_e4m3fn tensors) or E8M0 (uint8 exponents)
    group: int
    global_name: str | None  # the per-tensor fp32 global scale, if the format has one
    global_is_divisor: bool  # compressed-tensors: w = q * scale / global
    activation_scales: tuple[str, ...]  # read and dropped (weights only)

    def required(self) -> list[str]:
        return [self.codes, self.scale] + ([self.global_name] if self.global_name else [])


def _global_multiplier(t: torch.Tensor, layout: Fp4Layout, name: str) -> float:
    if t.numel() != 1 or not t.is_floating_point():
        raise ValueError(
            f"{name}: {layout.variant} expects one floating-point global scale, got "
            f"{t.dtype} of shape {tuple(t.shape)}"
        )
    v = float(t.reshape(()).to(torch.float64))
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"{name}: {layout.variant} global scale {v} is not a positive number")
    # the divisor becomes its correctly rounded fp32 reciprocal (fp4_pack.py: one multiply)
    return 1.0 / v if layout.global_is_divisor else v


def unpack_shard(
    t: dict[str, torch.Tensor], prefix: str, n: int, k: int, layout: Fp4Layout
) -> Fp4Weight:
    """One shard's tensors (this rank's part) -> its Fp4Weight [n, k], checked."""
    v, g = layout.variant, layout.group
    codes, scale = t[layout.codes], t[layout.scale]
    cname, sname = f"{prefix}.{layout.codes}", f"{prefix}.{layout.scale}"
    if codes.dtype != torch.uint8:
        raise ValueError(f"{cname}: {v} expects uint8 packed codes, got {codes.dtype}")
    want_dtype = torch.float8_e4m3fn if layout.scale_kind == E4M3 else torch.uint8
    if scale.dtype != want_dtype:
        raise ValueError(
            f"{sname}: {v} scale dtype {scale.dtype} is not supported (expects {want_dtype}, "
            f"{layout.scale_kind.upper()})"
        )
    if k % g:
        raise ValueError(f"{sname}: {v}: block size {g} does not divide K={k}")
    check_shape(codes, (n, k // 2), cname, v)
    if tuple(scale.shape) != (n, k // g):
        raise ValueError(
            f"{sname}: {v} expects shape {(n, k // g)} (one scale per {g} inputs), checkpoint "
            f"has {tuple(scale.shape)}"
        )
    raw = scale.view(torch.uint8)
    check_scale_bytes(raw, layout.scale_kind, sname)
    mult = 1.0
    if layout.global_name is not None:
        gname = f"{prefix}.{layout.global_name}"
        mult = _global_multiplier(t[layout.global_name], layout, gname)
    gscale = torch.full((n,), mult, dtype=torch.float32)
    return make_fp4_weight(codes, raw, gscale, g, layout.scale_kind)


def split(layout: Fp4Layout, name: str) -> TensorSplit:
    """How one of a shard's tensors narrows to a rank's part: codes along the outputs by rows and
    along the inputs by whole bytes (2 inputs), the scales by whole blocks; the global and the
    activation scales whole on every rank."""
    if name == layout.codes:
        return TensorSplit(out_dim=0, in_dim=1, in_pack=2)
    if name == layout.scale:
        return TensorSplit(out_dim=0, in_dim=1, in_pack=layout.group)
    if name == layout.global_name or name in layout.activation_scales:
        return TensorSplit(out_dim=None)
    raise KeyError(f"{layout.variant} linear has no tensor {name!r}")


class Fp4Method(StagedMethod):
    """FP4 codes with a scale byte per block and a global scale per shard.

    Tensor parallelism: codes narrow along the outputs by rows and along the inputs by whole
    bytes (2 inputs), the scales by whole blocks; the global scale is whole on every rank."""

    def __init__(self, layout: Fp4Layout) -> None:
        self.layout = layout
        self.variant = layout.variant

    @property
    def staged_names(self) -> list[str]:
        return self.layout.required()

    def split(self, name: str, prefix: str) -> TensorSplit:
        return split(self.layout, name)  # the module's rule, shared with the FP4 experts

    def create_weights(self, layer: Linear, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.fp4 = None

    def checkpoint_tensors(self, layer: Linear) -> tuple[list[str], list[str]]:
        required = self.layout.required() + (["bias"] if layer.bias is not None else [])
        return required, list(self.layout.activation_scales)

    def load(self, layer: Linear, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        if name in self.layout.activation_scales:
            note_activation_scales_ignored(self.variant)
        else:
            super().load(layer, name, shard, tensor)

    def process_after_loading(self, layer: Linear) -> None:
        parts = [
            unpack_shard(layer.staged[shard], prefix, rows, layer.in_features, self.layout)
            for prefix, shard, rows in staged_shards(layer)
        ]
        del layer.staged
        w = parts[0] if len(parts) == 1 else concat_rows(parts)
        dev = self.device
        layer.fp4 = Fp4Weight(
            w.packed.to(dev), w.scales.to(dev), w.gscale.to(dev), w.group_size, w.scale_kind
        )

    def apply(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch | None = None):
        return on_rows(dispatch.fp4_linear, x, layer.fp4, layer.bias, ops)

    def apply_gate_up_silu(self, layer: Linear, x: torch.Tensor, ops: KernelDispatch):
        if x.dim() != 2:
            return ops.silu_and_mul(self.apply(layer, x, ops))
        return dispatch.fp4_gate_up_silu(x, layer.fp4, layer.bias, ops)

    def scratch_numel(self, layer: Linear) -> int:
        return layer.out_features * layer.in_features


NVFP4_GROUP = 16
MXFP4_GROUP = 32


def ct_layout(fmt: str, group: int) -> Fp4Layout:
    """compressed-tensors nvfp4-pack-quantized / mxfp4-pack-quantized."""
    if fmt == "nvfp4-pack-quantized":
        return Fp4Layout(
            f"compressed-tensors NVFP4 g{group}",
            "weight_packed",
            "weight_scale",
            E4M3,
            group,
            "weight_global_scale",
            True,
            ("input_global_scale",),
        )
    return Fp4Layout(
        f"compressed-tensors MXFP4 g{group}",
        "weight_packed",
        "weight_scale",
        E8M0,
        group,
        None,
        False,
        ("input_global_scale",),
    )


def modelopt_layout(group: int) -> Fp4Layout:
    """ModelOpt NVFP4: weight uint8, weight_scale E4M3, weight_scale_2 the fp32 multiplier."""
    return Fp4Layout(
        f"ModelOpt NVFP4 g{group}",
        "weight",
        "weight_scale",
        E4M3,
        group,
        "weight_scale_2",
        False,
        ("input_scale",),
    )


__all__ = ["Fp4Layout", "Fp4Method", "ct_layout", "modelopt_layout", "split", "unpack_shard"]
