"""compressed-tensors `pack-quantized` checkpoints (W4A16 / W8A16) as llm-compressor writes them.

Per linear (N outputs, K inputs, b bits, pack = 32 / b): `weight_packed` int32 [N, K/pack], the
quantized value q (signed, [-2^(b-1), 2^(b-1))) stored as q + 2^(b-1) in consecutive b-bit
fields; `weight_scale` [N, K/g] (group strategy) or [N, 1] (channel); when asymmetric,
`weight_zero_point` packed the same way along the outputs ([N/pack, K/g]); `weight_shape` [2].
w = (q - zp) * scale. config_groups name the quantized modules (targets: "Linear" or "re:..."),
`ignore` the ones left in float (usually lm_head).

FP4 groups (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`; the format per group or for the
whole config) load through quant/fp4.py: `weight_packed` uint8 [N, K/2], `weight_scale` E4M3
[N, K/16] with `weight_global_scale` (NVFP4) or E8M0 uint8 [N, K/32] (MXFP4). FP4
`input_activations` (W4A4 checkpoints) are ignored: the weights are served, activations stay
in the run dtype.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from voltserve.services.executor.quant.base import (
    LinearMethod,
    QuantConfig,
    QuantFormatError,
    UnquantizedMethod,
)
from voltserve.services.executor.quant.fp4 import (
    MXFP4_GROUP,
    NVFP4_GROUP,
    Fp4Method,
    ct_layout,
    note_activation_scales_ignored,
)
from voltserve.services.executor.quant.group import (
    GroupQuantMethod,
    ShardCodes,
    act_order_perm,
    unpack_int32,
)
from voltserve.services.executor.quant.staged import check_shape
from voltserve.services.executor.tp.sharding import TensorSplit


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, cfg: dict[str, Any]) -> None:
        fmt = cfg.get("format")
        self.ignore = list(cfg.get("ignore") or [])
        self.groups: list[tuple[list[str], dict[str, Any]]] = []
        for gname, group in (cfg.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            gfmt = group.get("format") or fmt
            if gfmt in FP4_FORMATS:
                self.groups.append(
                    (list(group.get("targets") or []), _fp4_scheme(gname, gfmt, group))
                )
                continue
            if gfmt != "pack-quantized":
                raise QuantFormatError(
                    f"compressed-tensors group {gname!r}: format {gfmt!r} is not supported "
                    f"(only pack-quantized W4A16 / W8A16 and {', '.join(FP4_FORMATS)})"
                )
            if group.get("input_activations"):
                raise QuantFormatError(
                    f"compressed-tensors group {gname!r}: activation quantization is not "
                    "supported (weight-only W4A16 / W8A16)"
                )
            if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
                raise QuantFormatError(
                    f"compressed-tensors group {gname!r}: weights {w.get('type')} "
                    f"{w.get('num_bits')}-bit are not supported (int 4 or 8 bits)"
                )
            strategy = w.get("strategy", "group")
            if strategy not in ("group", "channel"):
                raise QuantFormatError(
                    f"compressed-tensors group {gname!r}: strategy {strategy!r} is not "
                    "supported (group, channel)"
                )
            self.groups.append((list(group.get("targets") or []), w))
        if not self.groups:
            raise QuantFormatError("compressed-tensors quantization_config has no config_groups")

    def _scheme(self, prefix: str) -> dict[str, Any] | None:
        if any(_matches(p, prefix) for p in self.ignore):
            return None
        for targets, w in self.groups:
            if any(t == "Linear" or _matches(t, prefix) for t in targets):
                return w
        return None

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        schemes = [self._scheme(p) for p in prefixes]
        if all(s is None for s in schemes):
            return UnquantizedMethod()
        if any(s != schemes[0] for s in schemes):
            raise QuantFormatError(
                f"{', '.join(prefixes)}: compressed-tensors schemes differ between the shards "
                "of a merged linear"
            )
        w = schemes[0]
        if "fp4" in w:
            return Fp4Method(ct_layout(w["fp4"], int(w["group_size"])))
        bits, sym = int(w["num_bits"]), bool(w.get("symmetric", True))
        strategy = w.get("strategy", "group")
        group = int(w.get("group_size") or 0) if strategy == "group" else 0
        variant = f"compressed-tensors W{bits}A16 {strategy}" + (f" g{group}" if group else "")
        variant += "" if sym else " asym"
        required = ["weight_packed", "weight_scale"] + ([] if sym else ["weight_zero_point"])

        def unpack(t: dict[str, torch.Tensor], prefix: str, n: int, k: int) -> ShardCodes:
            return _unpack(t, prefix, n, k, bits, group, sym, variant)

        pack = 32 // bits
        # Tensor parallelism: codes packed along the inputs (whole words per row-parallel
        # rank), asymmetric zero points along the outputs (whole words per column-parallel
        # rank); a row-parallel rank keeps every group's scale until group.unpack_local.
        splits = {
            "weight_packed": TensorSplit(out_dim=0, in_dim=1, in_pack=pack),
            "weight_scale": TensorSplit(out_dim=0),
            "weight_zero_point": TensorSplit(out_dim=0, out_pack=pack),
            "weight_shape": TensorSplit(out_dim=None, shape_of=True),
            "weight_g_idx": TensorSplit(out_dim=None),
        }
        return GroupQuantMethod(
            variant, required, ["weight_shape", "weight_g_idx"], unpack, splits=splits.get
        )


FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
# format -> (block size, scale dtype as compressed-tensors writes scale_dtype, strategies)
_FP4_RULES = {
    "nvfp4-pack-quantized": (NVFP4_GROUP, "torch.float8_e4m3fn", ("tensor_group", "group")),
    "mxfp4-pack-quantized": (MXFP4_GROUP, "torch.uint8", ("group",)),
}


def _fp4_scheme(gname: str, fmt: str, group: dict[str, Any]) -> dict[str, Any]:
    """The checked FP4 weights of one config group, as the scheme method_for compares."""
    w = group.get("weights") or {}
    where = f"compressed-tensors group {gname!r} ({fmt})"
    block, scale_dtype, strategies = _FP4_RULES[fmt]
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 4:
        raise QuantFormatError(
            f"{where}: weights {w.get('type')} {w.get('num_bits')}-bit are not FP4 (float 4-bit)"
        )
    if not w.get("symmetric", True):
        raise QuantFormatError(f"{where}: asymmetric FP4 weights are not supported")
    if w.get("strategy", "group") not in strategies:
        raise QuantFormatError(
            f"{where}: strategy {w.get('strategy')!r} is not supported ({', '.join(strategies)})"
        )
    g = int(w.get("group_size") or 0)
    if g != block:
        raise QuantFormatError(
            f"{where}: group size {g or None} is not supported (the kernels take blocks of "
            f"{block} for this format)"
        )
    sd = w.get("scale_dtype")
    if sd is not None and str(sd) != scale_dtype:
        raise QuantFormatError(
            f"{where}: scale_dtype {sd!r} is not supported (expects {scale_dtype})"
        )
    if group.get("output_activations"):
        raise QuantFormatError(f"{where}: output activation quantization is not supported")
    a = group.get("input_activations")
    if a:
        if a.get("type") != "float" or int(a.get("num_bits", 0)) != 4:
            raise QuantFormatError(
                f"{where}: input activations {a.get('type')} {a.get('num_bits')}-bit are not "
                "supported (weights-only; FP4 activation quantization is ignored)"
            )
        note_activation_scales_ignored(where)
    return {"fp4": fmt, "group_size": g}


def _unpack(t, prefix: str, n: int, k: int, bits: int, group: int, sym: bool, v: str):
    g = group or k
    pack = 32 // bits
    if k % g:
        raise ValueError(f"{prefix}.weight_scale: {v}: group size {g} does not divide K={k}")
    if k % pack:
        raise ValueError(f"{prefix}.weight_packed: {v}: K={k} is not a multiple of {pack}")
    G = k // g
    if "weight_shape" in t and tuple(int(x) for x in t["weight_shape"].tolist()) != (n, k):
        raise ValueError(
            f"{prefix}.weight_shape: {v}: {t['weight_shape'].tolist()}, model expects {[n, k]}"
        )
    check_shape(t["weight_packed"], (n, k // pack), f"{prefix}.weight_packed", v)
    check_shape(t["weight_scale"], (n, G), f"{prefix}.weight_scale", v)
    half = 1 << (bits - 1)
    codes = unpack_int32(t["weight_packed"], bits, dim=1)  # q + half, [N, K]
    s = t["weight_scale"].float()
    zp = torch.zeros_like(s)
    if not sym:
        zt = t["weight_zero_point"]
        check_shape(zt, (-(-n // pack), G), f"{prefix}.weight_zero_point", v)
        zp = unpack_int32(zt, bits, dim=0)[:n].float() - half
    perm = None
    if "weight_g_idx" in t:
        perm = act_order_perm(t["weight_g_idx"], g, f"{prefix}.weight_g_idx", v)
        if perm is not None:
            codes = codes[:, perm].contiguous()
    return ShardCodes(codes, s, -(zp + half) * s, bits, g, perm)
