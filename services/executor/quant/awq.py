"""AWQ GEMM checkpoints as AutoAWQ writes them.

Per linear (K inputs, N outputs, group g): `qweight` int32 [K, N/8] and `qzeros` int32 [K/g, N/8]
hold 8 nibbles per word in AWQ's interleaved order (nibble i holds column 8c + AWQ_ORDER[i]),
`scales` fp16 [K/g, N]; w[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n] (the weight is stored
as x @ W, inputs along the rows). The lm_head and the modules `modules_to_not_convert` names
(by whole dotted components: base.module_listed) stay unquantized.
"""

from __future__ import annotations

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
    unpack_int32,
)
from voltserve.services.executor.quant.staged import check_shape
from voltserve.services.executor.tp.sharding import TensorSplit

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# Tensor parallelism: the outputs are packed 8 per int32 (interleaved within the word only), so
# a column-parallel rank takes whole words; a row-parallel one its rows of qweight, the scales
# and zeros whole (cut to its groups after unpacking: group.unpack_local).
_SPLITS = {
    "qweight": TensorSplit(out_dim=1, out_pack=8, in_dim=0),
    "qzeros": TensorSplit(out_dim=1, out_pack=8),
    "scales": TensorSplit(out_dim=1),
}


def _deinterleave(nibbles: torch.Tensor) -> torch.Tensor:
    """[R, 8C] in nibble order -> [R, 8C] in column order."""
    R, C8 = nibbles.shape
    v = nibbles.view(R, C8 // 8, 8)
    out = torch.empty_like(v)
    out[:, :, list(AWQ_ORDER)] = v
    return out.view(R, C8)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, cfg: dict[str, Any]) -> None:
        version = str(cfg.get("version", "gemm")).lower()
        self.bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        self.group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        self.zero_point = bool(cfg.get("zero_point", True))
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        if version != "gemm":
            raise QuantFormatError(
                f"AWQ version {version!r} is not supported (only AutoAWQ's GEMM layout); "
                "gemv, marlin and exllama checkpoints must be re-exported as GEMM"
            )
        if self.bits != 4:
            raise QuantFormatError(f"AWQ {self.bits}-bit is not supported (only 4-bit)")
        if not self.zero_point:
            raise QuantFormatError("AWQ without zero_point is not supported (GEMM has zeros)")
        self.variant = f"AWQ GEMM 4-bit g{self.group_size}"

    def describe(self) -> str:
        return self.variant

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        listed = [p == "lm_head" or module_listed(p, self.skip) for p in prefixes]
        if all(listed):
            return UnquantizedMethod()
        if any(listed):
            raise QuantFormatError(
                f"{', '.join(prefixes)}: AWQ modules_to_not_convert names some shards of a "
                "merged linear but not the others"
            )
        return GroupQuantMethod(
            self.variant, ["qweight", "qzeros", "scales"], [], self._unpack, splits=_SPLITS.get
        )

    def _unpack(self, t: dict[str, torch.Tensor], prefix: str, n: int, k: int) -> ShardCodes:
        g, v = self.group_size, self.variant
        if g <= 0:
            g = k
        if k % g:
            raise ValueError(f"{prefix}.qweight: {v}: group size {g} does not divide K={k}")
        if n % 8:
            raise ValueError(f"{prefix}.qweight: {v}: N={n} is not a multiple of 8")
        check_shape(t["qweight"], (k, n // 8), f"{prefix}.qweight", v)
        check_shape(t["qzeros"], (k // g, n // 8), f"{prefix}.qzeros", v)
        check_shape(t["scales"], (k // g, n), f"{prefix}.scales", v)
        for name in ("qweight", "qzeros"):
            if t[name].dtype != torch.int32:
                raise ValueError(f"{prefix}.{name}: {v} expects int32, got {t[name].dtype}")
        q = _deinterleave(unpack_int32(t["qweight"], 4, dim=1))  # [K, N]
        z = _deinterleave(unpack_int32(t["qzeros"], 4, dim=1)).float()  # [K/g, N]
        s = t["scales"].float()
        return ShardCodes(q.t().contiguous(), s.t().contiguous(), (-z * s).t().contiguous(), 4, g)
