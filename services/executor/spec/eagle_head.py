"""An EAGLE-1 draft head for the Llama family, loaded from its own checkpoint folder.

The layout is the one the public EAGLE heads for Llama use (and vLLM reads): config.json is a
Llama config (usually num_hidden_layers 1, the target's hidden and vocabulary sizes), and the
safetensors hold
  fc.weight [hidden, 2 * hidden] (+ fc.bias [hidden] in the original EAGLE training code),
  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
  layers.{i}.post_attention_layernorm.weight, and layers.{i}.input_layernorm.weight for i > 0.
The head reuses the target's token embedding and lm_head; an embed_tokens or lm_head tensor in
the folder is ignored, as is layer 0's input_layernorm (EAGLE-1 has none).

One step of the head at position p reads the pair (embedding of token x_{p+1}, feature f_p),
where f_p is the target's last hidden state (after its final norm) at position p:
  x = fc(cat(embed(x_{p+1}), f_p)); then the decoder layers (layer 0 without its input norm);
  the output (last layer's output + residual, no final norm) is the head's estimate of f_{p+1},
  and the target's lm_head turns it into the proposed token x_{p+2}.

EAGLE-3 heads (fc over three target layers' hidden states, a reduced draft vocabulary with a
d2t map, their own norm and lm_head) are a different format, refused here by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import AttentionMetadata, Linear, rotary_and_ops
from voltserve.services.executor.models.llama import DecoderLayer, KVCache, ModelArch
from voltserve.shared import startup

logger = logging.getLogger(__name__)

# config.json architectures of EAGLE-1 heads for Llama (vLLM's names and the plain Llama one).
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
# Checkpoint tensors the head does not own (shared with the target, or absent in EAGLE-1).
_IGNORED = ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")


class _NoInputNorm(nn.Module):
    """EAGLE-1's first layer: the fused features enter attention without a norm."""

    def forward(self, ops: KernelDispatch, x: torch.Tensor, residual=None) -> torch.Tensor:
        assert residual is None, "only the first layer goes without an input norm"
        return x


class EagleHead(nn.Module):
    ops: KernelDispatch | None  # set by the runner (the target's)
    cos_sin_cache: torch.Tensor

    def __init__(self, arch: ModelArch, dtype: torch.dtype, fc_bias: bool) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc = Linear(2 * h, {None: h}, fc_bias, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype, None, f"layers.{i}", index=i) for i in range(arch.num_layers)
        )
        self.layers[0].input_layernorm = _NoInputNorm()
        rotary_and_ops(self, arch)

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]: the target's embedding of x_{p+1}
        features: torch.Tensor,  # [T, hidden]: f_p (the target's, or the head's own output)
        positions: torch.Tensor,  # [T] int64: p
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        step: int = 0,
    ) -> torch.Tensor:
        """The head's output per row, [T, hidden] (its estimate of f_{p+1}); every step
        (which proposal of the group) runs the same layers."""
        ops = self.ops
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1), ops)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(ops, positions, x, residual, kv, meta, self.cos_sin_cache)
        return x + residual


@dataclass
class LoadedHead:
    """What the runner keeps of a draft (the draft model's LoadedModel has the same two)."""

    model: EagleHead
    arch: ModelArch


def _tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            names.update(st.keys())  # noqa: SIM118 (safe_open is not a dict)
    return names


def _strip(name: str) -> str:
    # Some exports keep the head's tensors under "model." (a LlamaModel-shaped state dict).
    return name[len("model.") :] if name.startswith("model.") else name


def load_eagle_head(path: str, target_arch: ModelArch, dtype, device) -> LoadedHead:
    """The head in `path`, refused (naming the field) unless it fits the target."""
    from voltserve.services.executor.loader import (
        ModelLoadError,
        iter_tensors,
        load_weights,
        parse_arch,
        read_hf_config,
        weight_files,
    )

    where = f"speculative EAGLE head {path}"
    if not Path(path).is_dir():
        raise startup.StartupError(f"{where}: not a folder")
    try:
        hf = dict(read_hf_config(path))
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if any(a in EAGLE3_ARCHITECTURES for a in archs) or "draft_vocab_size" in hf:
            raise startup.StartupError(
                f"{where}: an EAGLE-3 head ({archs}); method 'eagle3' is not supported yet, "
                "use an EAGLE-1 head with method 'eagle'"
            )
        if not any(a in EAGLE_ARCHITECTURES for a in archs):
            raise startup.StartupError(
                f"{where}: architectures {archs} is not an EAGLE head for the Llama family "
                f"(expected one of {list(EAGLE_ARCHITECTURES)})"
            )
        hf["architectures"] = ["LlamaForCausalLM"]
        arch = parse_arch(hf)
        files = weight_files(Path(path))
    except ModelLoadError as e:
        raise startup.StartupError(f"{where}: {e}") from e
    for field in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(arch, field), getattr(target_arch, field)
        if mine != theirs:
            raise startup.StartupError(
                f"{where}: {field} {mine} differs from the target's {theirs}; the head reads "
                "the target's hidden states and shares its embedding and lm_head"
            )
    if arch.num_experts:
        raise startup.StartupError(f"{where}: a mixture-of-experts head is not supported")
    names = {_strip(n) for n in _tensor_names(files)}
    if "d2t" in names or "t2d" in names:
        raise startup.StartupError(
            f"{where}: has a draft vocabulary map (d2t/t2d): an EAGLE-3 head; method 'eagle3' "
            "is not supported yet"
        )
    with torch.device(device):
        head = EagleHead(arch, dtype, fc_bias="fc.bias" in names)
    tensors = (
        (n, t) for n, t in ((_strip(n), t) for n, t in iter_tensors(files)) if n not in _IGNORED
    )
    try:
        load_weights(head, path, tensors)
    except ModelLoadError as e:
        raise startup.StartupError(f"{where}: {e}") from e
    logger.info(
        "EAGLE head %s: %d layer(s), hidden %d, fc bias %s",
        path,
        arch.num_layers,
        arch.hidden_size,
        "fc.bias" in names,
    )
    return LoadedHead(head, arch)
