"""NVIDIA ModelOpt (TensorRT Model Optimizer) NVFP4 checkpoints, as its unified Hugging Face export
writes them: the settings in hf_quant_config.json (`quantization`: quant_algo NVFP4,
group_size 16, exclude_modules) or in config.json's quantization_config (quant_method
modelopt). Per linear: `weight` uint8 [N, K/2] (two E2M1 codes a byte, low nibble first),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` fp32 (the per-tensor multiplier), and
`input_scale` (the activations' FP4 global scale: ignored, weights only). Modules matched by
`exclude_modules` (shell-style patterns on the module name) stay float.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from voltserve.services.executor.quant.base import (
    LinearMethod,
    QuantConfig,
    QuantFormatError,
    UnquantizedMethod,
)
from voltserve.services.executor.quant.fp4 import (
    NVFP4_GROUP,
    Fp4Method,
    modelopt_layout,
    note_activation_scales_ignored,
)

SUPPORTED_ALGOS = ("NVFP4",)


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, p) or name == p or name.endswith("." + p) for p in patterns)


class ModelOptConfig(QuantConfig):
    name = "modelopt"

    def __init__(self, cfg: dict[str, Any]) -> None:
        algo = str(cfg.get("quant_algo") or "")
        if algo.upper() not in SUPPORTED_ALGOS:
            raise QuantFormatError(
                f"ModelOpt quant_algo {algo or None!r} is not supported (only "
                f"{', '.join(SUPPORTED_ALGOS)})"
            )
        kv = cfg.get("kv_cache_quant_algo")
        if kv:
            raise QuantFormatError(
                f"ModelOpt kv_cache_quant_algo {kv!r} is not supported (the KV cache is kept in "
                "the run dtype; export without KV-cache quantization)"
            )
        self.group = int(cfg.get("group_size") or NVFP4_GROUP)
        if self.group != NVFP4_GROUP:
            raise QuantFormatError(
                f"ModelOpt NVFP4 group_size {self.group} is not supported (only {NVFP4_GROUP})"
            )
        self.exclude = [str(p) for p in cfg.get("exclude_modules") or []]
        self.variant = f"ModelOpt NVFP4 g{self.group}"
        note_activation_scales_ignored(self.variant)

    def describe(self) -> str:
        return self.variant

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        skipped = [_excluded(p, self.exclude) for p in prefixes]
        if all(skipped):
            return UnquantizedMethod()
        if any(skipped):
            raise QuantFormatError(
                f"{', '.join(prefixes)}: ModelOpt exclude_modules leaves some shards of a merged "
                "linear float and quantizes the others"
            )
        return Fp4Method(modelopt_layout(self.group))
