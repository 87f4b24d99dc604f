"""Which quantization a checkpoint uses, as vLLM decides it: config.json's
`quantization_config.quant_method` (awq, gptq, compressed-tensors, modelopt: the loader
puts a ModelOpt hf_quant_config.json there), or a GGUF path. The
`--quantization` flag forces a method; a flag that contradicts the checkpoint is an error."""

from __future__ import annotations

from typing import Any

from voltserve.services.executor.quant.base import UNQUANTIZED, QuantConfig, QuantFormatError
from voltserve.shared.config import QUANTIZATION_METHODS as METHODS

_ALIASES = {
    "compressed_tensors": "compressed-tensors",
    "gptq_v2": "gptq",
    "modelopt_fp4": "modelopt",
}


def detected_method(hf: dict[str, Any], is_gguf: bool) -> str | None:
    if is_gguf:
        return "gguf"
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method") or "").lower()
    method = _ALIASES.get(method, method)
    if method not in METHODS:
        raise QuantFormatError(
            f"config.json quantization_config.quant_method {qc.get('quant_method')!r} is not "
            f"supported; supported: {list(METHODS[:-1])} (and GGUF files)"
        )
    return method


def quant_config(hf: dict[str, Any], forced: str | None, is_gguf: bool = False) -> QuantConfig:
    """The QuantConfig of a Hugging Face folder (GGUF sources bring their own)."""
    method = detected_method(hf, is_gguf)
    if forced is not None:
        forced = _ALIASES.get(forced, forced)
        if forced not in METHODS:
            raise QuantFormatError(f"--quantization {forced!r}: choose one of {list(METHODS)}")
        if forced != method:
            found = f"a {method} checkpoint" if method else "an unquantized checkpoint"
            raise QuantFormatError(f"--quantization {forced} was given, but the model is {found}")
    if method is None or method == "gguf":
        return UNQUANTIZED
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if method == "awq":
        from voltserve.services.executor.quant.awq import AWQConfig

        return AWQConfig(qc)
    if method == "gptq":
        from voltserve.services.executor.quant.gptq import GPTQConfig

        return GPTQConfig(qc)
    if method == "modelopt":
        from voltserve.services.executor.quant.modelopt import ModelOptConfig

        return ModelOptConfig(qc)
    from voltserve.services.executor.quant.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig(qc)
