"""The multi-token-prediction (MTP) layers a Qwen3-Next / Qwen3.5 / 3.6 checkpoint trains
beside its model, loaded from the target's own folder.

Layout (config.json `mtp_num_hidden_layers`, in text_config for the vision-language classes;
tensors under `mtp.`):
  mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight [hidden] (zero-centred),
  mtp.fc.weight [hidden, 2 * hidden] (over [normed embedding; normed hidden], no bias),
  mtp.layers.{i}.*: a decoder layer of the target's family with gated full attention and the
  target's MLP (sparse where the target's rule makes layer i sparse),
  mtp.norm.weight [hidden] (zero-centred).
The embedding and the lm_head are the target's. The MTP layers run unquantized (the checkpoint's
float tensors in the run dtype) whatever the target's format, as the published AWQ checkpoints
keep them; quantized MTP tensors are refused by name.

One step at position p reads the pair (token x_{p+1}, hidden h_p), h_p the target's last hidden
state (after its final norm) at p, or the previous step's output:
  x = fc(cat(norm_e(embed(x_{p+1})), norm_h(h_p))); layer (step mod the number of layers);
  out = norm(x + residual), the next step's hidden; the lm_head turns it into x_{p+2}.

DeepSeek-V3-style MTP (`num_nextn_predict_layers`, its own embedding and head per layer) is a
different architecture, refused here by name.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import AttentionMetadata, Linear, rotary_and_ops
from voltserve.services.executor.models.llama import KVCache
from voltserve.services.executor.models.qwen3_next import (
    FULL,
    HybridArch,
    HybridDecoderLayer,
    ZeroCenteredRMSNorm,
)
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.shared import startup
from voltserve.shared.gguf_files import is_gguf

logger = logging.getLogger(__name__)

PREFIX = "mtp."
# Tensors of the quantized formats (AWQ, GPTQ, compressed-tensors) in place of a linear's weight.
_QUANTIZED = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale")


class MtpHead(nn.Module):
    ops: KernelDispatch | None  # set by the runner (the target's)
    cos_sin_cache: torch.Tensor

    def __init__(self, arch: HybridArch, dtype: torch.dtype) -> None:
        """arch: the target's, with one full-attention layer per MTP layer (mtp_arch)."""
        super().__init__()
        self.arch = arch
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps, dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps, dtype)
        self.fc = Linear(2 * h, {None: h}, False, dtype, None, ["fc"])
        lay = TPLayout.build(arch)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(arch, dtype, None, f"layers.{i}", i, None, lay)
            for i in range(arch.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(h, eps, dtype)
        rotary_and_ops(self, arch)

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]: the target's embedding of x_{p+1}
        hidden: torch.Tensor,  # [T, hidden]: h_p (the target's, or the previous step's output)
        positions: torch.Tensor,  # [T] int64: p
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        step: int = 0,
    ) -> torch.Tensor:
        """The step's output per row, [T, hidden]: the next step's hidden and the lm_head's
        input. step: which proposal of the group (0 for catch-up rows); its layer is step mod
        the number of layers, each with its own KV cache."""
        ops = self.ops
        e = self.pre_fc_norm_embedding(ops, embeds)
        hn = self.pre_fc_norm_hidden(ops, hidden.to(embeds.dtype))
        x = self.fc(torch.cat([e, hn], dim=-1), ops)
        i = step % len(self.layers)
        x, residual = self.layers[i](
            ops, positions, x, None, kv_caches[i], meta, self.cos_sin_cache
        )
        return self.norm(ops, x, residual)


@dataclass
class LoadedMtp:
    """What the runner keeps of a proposer's model (as a draft model's LoadedModel)."""

    model: MtpHead
    arch: HybridArch


def mtp_arch(target: HybridArch, num_layers: int) -> HybridArch:
    """The target's shapes with num_layers full-attention layers (the MTP layers' KV layout)."""
    return dataclasses.replace(target, num_layers=num_layers, layer_types=(FULL,) * num_layers)


def mtp_num_layers(path: str, target_arch) -> int:
    """The checkpoint's number of MTP layers, refused (naming the key) unless this build runs
    them."""
    from voltserve.services.executor.loader import ModelLoadError, read_hf_config, text_config

    where = f"--speculative-config method 'mtp' with {path}"
    if not isinstance(target_arch, HybridArch):
        raise startup.StartupError(
            f"{where}: {target_arch.architecture} has no MTP layers this build runs (method "
            "'mtp' serves the Qwen3-Next / Qwen3.5 / 3.6 families)"
        )
    if is_gguf(path):
        raise startup.StartupError(
            f"{where}: the MTP layers of a GGUF file (llama.cpp's nextn blocks) are not loaded; "
            "serve the Hugging Face folder for method 'mtp'"
        )
    try:
        hf = text_config(read_hf_config(path))
    except ModelLoadError as e:
        raise startup.StartupError(f"{where}: {e}") from e
    if hf.get("num_nextn_predict_layers"):
        raise startup.StartupError(
            f"{where}: config.json has num_nextn_predict_layers (DeepSeek-V3-style MTP), an "
            "architecture this build does not run; method 'mtp' reads mtp_num_hidden_layers"
        )
    n = hf.get("mtp_num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise startup.StartupError(
            f"{where}: config.json has no mtp_num_hidden_layers >= 1 (got {n!r}): the "
            "checkpoint was not trained with MTP layers"
        )
    return n


def load_mtp_head(path: str, target_arch: HybridArch, dtype, device) -> LoadedMtp:
    """The MTP layers of the target's checkpoint in `path`, refused by name when absent."""
    from voltserve.services.executor.loader import ModelLoadError, load_weights, weight_files

    n = mtp_num_layers(path, target_arch)
    where = f"--speculative-config method 'mtp' with {path}"
    arch = mtp_arch(target_arch, n)
    try:
        files = weight_files(Path(path))
    except ModelLoadError as e:
        raise startup.StartupError(f"{where}: {e}") from e
    tensors = [(name[len(PREFIX) :], t) for name, t in _mtp_tensors(files)]
    if not tensors:
        raise startup.StartupError(
            f"{where}: the checkpoint has no mtp.* weight tensors (its config names "
            f"{n} MTP layer(s), but a conversion dropped them)"
        )
    quantized = next((name for name, _ in tensors if name.endswith(_QUANTIZED)), None)
    if quantized is not None:
        raise startup.StartupError(
            f"{where}: its MTP layers are quantized (mtp.{quantized}); they are run unquantized "
            "only (the published AWQ checkpoints keep them float: modules_to_not_convert 'mtp')"
        )
    with torch.device(device):
        head = MtpHead(arch, dtype)
    try:
        load_weights(head, path, iter(tensors))
    except ModelLoadError as e:
        raise startup.StartupError(f"{where}: MTP weights: {e}") from e
    logger.info("MTP head of %s: %d layer(s), hidden %d", path, n, arch.hidden_size)
    return LoadedMtp(head, arch)


def _mtp_tensors(files):
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(PREFIX):
                    yield name, st.get_tensor(name)
