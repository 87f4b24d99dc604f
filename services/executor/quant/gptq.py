"""GPTQ checkpoints as GPTQModel / AutoGPTQ write them.

Per linear (K inputs, N outputs, b bits, pack = 32 / b, group g): `qweight` int32 [K/pack, N]
packed along the input dimension (field j of word r is input r * pack + j), `qzeros` int32
[K/g, N/pack] packed along the outputs, `scales` fp16 [K/g, N], `g_idx` int32 [K] (the group of
each input; with desc_act the groups follow the activation order). w[k, n] = (q[k, n] -
zero[g_idx[k], n]) * s[g_idx[k], n]. checkpoint_format "gptq" (v1, AutoGPTQ's and GPTQModel's
default on disk) stores zero - 1; "gptq_v2" stores the zero itself. Act-order is served by
permuting the input columns so each group is contiguous (the kernels' perm).
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
    module_listed,
)
from voltserve.services.executor.quant.group import (
    GroupQuantMethod,
    ShardCodes,
    act_order_perm,
    unpack_int32,
)
from voltserve.services.executor.quant.staged import check_shape
from voltserve.services.executor.tp.sharding import TensorSplit


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.bits = int(cfg.get("bits", 4))
        self.group_size = int(cfg.get("group_size", 128))
        self.desc_act = bool(cfg.get("desc_act", False))
        self.sym = bool(cfg.get("sym", True))
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantFormatError(
                f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)"
            )
        self.v1 = fmt == "gptq"
        self.quant_lm_head = bool(cfg.get("lm_head", False))
        self.dynamic: dict[str, dict[str, Any]] = dict(cfg.get("dynamic") or {})
        # AutoGPTQ's per-block module list: a linear of the blocks that it does not name
        # stays float (by whole dotted components: base.module_listed).
        in_block = cfg.get("modules_in_block_to_quantize")
        self.in_block = (
            None
            if in_block is None
            else [m for group in in_block for m in ([group] if isinstance(group, str) else group)]
        )

    def describe(self) -> str:
        return (
            f"GPTQ {self.bits}-bit g{self.group_size} desc_act={self.desc_act} "
            f"sym={self.sym} ({'v1' if self.v1 else 'v2'})"
        )

    def _overrides(self, prefix: str) -> dict[str, Any] | None:
        """GPTQModel's per-module `dynamic` rules: '-:regex' leaves a module unquantized,
        '+:regex' (or a bare regex) overrides bits / group_size / ...; None = skip (also a
        decoder linear that modules_in_block_to_quantize leaves out)."""
        in_blocks = prefix != "lm_head"  # the lm_head is `lm_head`'s to decide
        if in_blocks and self.in_block is not None and not module_listed(prefix, self.in_block):
            return None
        for key, over in self.dynamic.items():
            neg = key.startswith("-:")
            pattern = key[2:] if key[:2] in ("-:", "+:") else key
            if re.match(pattern, prefix):
                return None if neg else dict(over or {})
        return {}

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        if prefixes == ["lm_head"] and not self.quant_lm_head:
            return UnquantizedMethod()
        overs = [self._overrides(p) for p in prefixes]
        if all(o is None for o in overs):
            return UnquantizedMethod()
        if any(o is None for o in overs) or any(o != overs[0] for o in overs):
            raise QuantFormatError(
                f"{', '.join(prefixes)}: GPTQ dynamic rules differ between the shards of a "
                "merged linear"
            )
        bits = int(overs[0].get("bits", self.bits))
        group = int(overs[0].get("group_size", self.group_size))
        variant = f"GPTQ {bits}-bit g{group}"
        if bits not in (4, 8):
            raise QuantFormatError(
                f"{prefixes[0]}.qweight: {variant} is not supported (GPTQ 4-bit and 8-bit only)"
            )

        def unpack(t: dict[str, torch.Tensor], prefix: str, n: int, k: int) -> ShardCodes:
            return self._unpack(t, prefix, n, k, bits, group, variant)

        pack = 32 // bits
        # Tensor parallelism: qweight is packed along the inputs (whole words of `pack` rows
        # per row-parallel rank), qzeros along the outputs (whole words per column-parallel
        # rank); scales, zeros and g_idx stay whole for a row-parallel rank, which keeps the
        # groups (act-order: any groups) of its own input rows (group.unpack_local).
        splits = {
            "qweight": TensorSplit(out_dim=1, in_dim=0, in_pack=pack),
            "qzeros": TensorSplit(out_dim=1, out_pack=pack),
            "scales": TensorSplit(out_dim=1),
            "g_idx": TensorSplit(out_dim=None),
        }
        return GroupQuantMethod(
            variant, ["qweight", "qzeros", "scales"], ["g_idx"], unpack, splits=splits.get
        )

    def _unpack(self, t, prefix: str, n: int, k: int, bits: int, group: int, v: str) -> ShardCodes:
        g = k if group <= 0 else group
        pack = 32 // bits
        if k % g:
            raise ValueError(f"{prefix}.qweight: {v}: group size {g} does not divide K={k}")
        if k % pack or n % pack:
            raise ValueError(f"{prefix}.qweight: {v}: K={k} and N={n} must be multiples of {pack}")
        G = k // g
        check_shape(t["qweight"], (k // pack, n), f"{prefix}.qweight", v)
        check_shape(t["qzeros"], (G, n // pack), f"{prefix}.qzeros", v)
        check_shape(t["scales"], (G, n), f"{prefix}.scales", v)
        q = unpack_int32(t["qweight"], bits, dim=0)  # [K, N]
        # v1 stores zero - 1 (masked to `bits` bits); the published dequant adds the 1 back.
        z = unpack_int32(t["qzeros"], bits, dim=1).float() + (1.0 if self.v1 else 0.0)  # [G, N]
        s = t["scales"].float()
        codes = q.t().contiguous()  # [N, K]
        perm = None
        g_idx = t.get("g_idx")
        if g_idx is not None:
            check_shape(g_idx, (k,), f"{prefix}.g_idx", v)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
                raise ValueError(f"{prefix}.g_idx: {v}: group ids outside [0, {G})")
            perm = act_order_perm(g_idx, g, f"{prefix}.g_idx", v)
            if perm is not None:
                codes = codes[:, perm].contiguous()
        return ShardCodes(codes, s.t().contiguous(), (-z * s).t().contiguous(), bits, g, perm)
