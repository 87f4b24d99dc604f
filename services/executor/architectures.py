"""Which config.json architectures the executor serves, read without torch: the executor
checks a model folder against this before it imports the engine, so a folder it cannot serve
is refused in a fraction of a second."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Architectures (config.json "architectures") -> the flags that distinguish them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    # Mixture of experts (models/moe.py): the Qwen3 / Qwen2 attention plus a sparse MoE block.
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": "qwen"},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "moe": "qwen"},
    "MixtralForCausalLM": {"moe": "mixtral"},
    # Hybrid linear attention (models/qwen3_next.py): Gated DeltaNet layers with a gated full
    # attention every few layers. The vision-language classes (`vl`) keep the text model's
    # config in text_config and its weights under model.language_model.; their text part is
    # served (image inputs are refused by the gateway).
    "Qwen3NextForCausalLM": {"qk_norm": True, "hybrid": "fused", "moe": "qwen"},
    "Qwen3_5ForCausalLM": {"qk_norm": True, "hybrid": "split"},
    "Qwen3_5ForConditionalGeneration": {"qk_norm": True, "hybrid": "split", "vl": True},
    # Qwen3.5-MoE: every layer sparse, top-k always renormalised, a shared expert; no dense
    # intermediate_size.
    "Qwen3_5MoeForCausalLM": {"qk_norm": True, "hybrid": "split", "moe": "qwen", "all_moe": True},
    "Qwen3_5MoeForConditionalGeneration": {
        "qk_norm": True,
        "hybrid": "split",
        "moe": "qwen",
        "all_moe": True,
        "vl": True,
    },
}


class ModelLoadError(ValueError):
    """The model folder is unusable; the message says what is missing or wrong."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    d = Path(model_dir)
    if d.is_file():
        kind = "a GGUF file" if d.suffix.lower() == ".gguf" else "a file"
        raise ModelLoadError(
            f"{d} is {kind}, not a model folder: this loader reads a Hugging Face folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    if not d.is_dir():
        raise ModelLoadError(f"model folder {d} does not exist")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"model folder {d} has no config.json")
    return read_json(cfg)


def supported_architecture(hf: dict[str, Any]) -> str:
    """The first of config.json's architectures that is served; ModelLoadError naming them and
    the supported ones otherwise."""
    archs = hf.get("architectures") or []
    name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if name is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or '(config.json has no architectures)'}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def check_model_folder(model: str) -> None:
    """What can be refused before the engine is imported: a Hugging Face folder whose
    config.json is missing, malformed or names no served architecture (a GGUF file, or
    anything else, is left to the loader)."""
    d = Path(model)
    if d.is_file() or not d.exists():
        return
    supported_architecture(read_hf_config(d))
