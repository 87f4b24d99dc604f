"""The KV cache's storage type (--kv-cache-dtype) and, for the one-byte formats, what the
attention layers do with it: quantize K (after rotary) and V on the cache write, widen the pages
a step reads before attention.

"auto" keeps the run dtype; "fp16" stores float16 whatever the run dtype (the attention reads
widen it again); "fp8"/"fp8_e4m3" and "fp8_e5m2" store one byte per element in torch.uint8
(kernels/attention/fp8.py defines the rounding). E4M3 divides by a per-layer scale on the way
in and multiplies on the way out: k_scale / v_scale from the checkpoint where it ships them
(compressed-tensors names them `<layer>.self_attn.k_scale` / `.v_scale`, ModelOpt
`<layer>.self_attn.k_proj.k_scale` / `.v_proj.v_scale`), else 1.0.

Every attention layer with a paged cache takes its KVQuant: the dense and MoE families, the
hybrid models' full-attention layers, and a proposer's own model (a draft model, an EAGLE head,
the MTP layers), whose cache is in the target's format too (it is sized and allocated at the
target's storage dtype; its proposals only ever change speed). The write and the widening are
ops of the kernel dispatch (`reshape_and_cache_fp8`, `expand_kv_pages`): the numba kernels on
CUDA (capturable in graphs, no host sync), their torch references on the CPU, so the model code
has no device branch. The widened pages go to one workspace of one layer's cache shape shared by
every layer (kv_workspace.py), which the run dtype's attention kernels read with the step's own
block tables.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from voltserve.kernels.attention import fp8
from voltserve.services.executor.kv_workspace import KVWorkspace
from voltserve.services.executor.models.layers import AttentionMetadata, paged_attend
from voltserve.shared import startup
from voltserve.shared.config import EngineConfig
from voltserve.shared.gguf_files import is_gguf

logger = logging.getLogger(__name__)

_FP8 = {"fp8": fp8.E4M3, "fp8_e4m3": fp8.E4M3, "fp8_e5m2": fp8.E5M2}
# The ops the graphs hold beyond the dense ones with a one-byte cache (the runner checks they
# capture): decode graphs write and read the one-byte pages directly; speculation's verify
# graphs, prefill-shaped, widen the pages they read.
GRAPH_OPS = ("reshape_and_cache_fp8", "expand_kv_pages", "paged_decode_attention_fp8")
_SCALE_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:k_proj\.(k)_scale|v_proj\.(v)_scale|([kv])_scale)$"
)


@dataclass(frozen=True)
class KVQuant:
    """One attention layer's one-byte KV format and its scales, and the workspace its pages are
    widened into (shared by every layer: kv_workspace.py)."""

    fmt: str  # fp8.E5M2 or fp8.E4M3
    k_scale: float = 1.0
    v_scale: float = 1.0
    workspace: KVWorkspace | None = field(default=None, compare=False, repr=False)

    def write(
        self,
        ops,
        k: torch.Tensor,  # [T, num_kv_heads * head_dim] (after rotary)
        v: torch.Tensor,
        k_cache: torch.Tensor,  # uint8 [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The step's K and V into their cache slots (a negative slot is skipped)."""
        heads, hd = k_cache.shape[1], k_cache.shape[3]
        ops.reshape_and_cache_fp8(
            k.view(-1, heads, hd),
            v.view(-1, heads, hd),
            k_cache,
            v_cache,
            slot_mapping,
            self.fmt,
            self.k_scale,
            self.v_scale,
        )

    def attend(
        self,
        ops,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's query rows over the one-byte cache (written already). A
        decode-only step (one query row per sequence: what the decode graphs run), or one whose
        rows are attended as decode rows (layers.ROW_DECODE_MAX_QUERY), on CUDA: the decode
        kernel reads the one-byte pages itself, converting per tile
        (kernels/attention/decode_fp8.py); every other step, and the reference path (CPU),
        widens only the pages the step reads (`expanded`)."""
        direct = ops.impl["paged_decode_attention_fp8"] == "cuda"
        if direct:
            meta = meta.decode_rows() or meta
        if not (direct and meta.is_decode):
            return self.expanded(ops, q, k_cache, v_cache, meta, scale)
        return ops.paged_decode_attention_fp8(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            fmt=self.fmt,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def expanded(
        self,
        ops,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The pages of the block tables' columns below each sequence's length widened into the
        workspace (same block ids), then the run dtype's attention over it, tables unchanged.
        Never syncs with the host on CUDA (kv_expand.py: the grid is the tables' shape)."""
        k_ws, v_ws = self.workspace.views(k_cache)
        ops.expand_kv_pages(
            k_cache,
            v_cache,
            k_ws,
            v_ws,
            meta.block_tables,
            meta.seq_lens,
            self.fmt,
            self.k_scale,
            self.v_scale,
        )
        return paged_attend(ops, q, k_ws, v_ws, meta, scale)


def fp8_format(kv_cache_dtype: str) -> str | None:
    """The fp8 format of a --kv-cache-dtype value; None for auto / fp16."""
    return _FP8.get(kv_cache_dtype)


def storage_dtype(kv_cache_dtype: str, run_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' torch dtype."""
    if kv_cache_dtype == "auto":
        return run_dtype
    if kv_cache_dtype == "fp16":
        return torch.float16
    return torch.uint8


def check_supported(config: EngineConfig, run_dtype: torch.dtype, device) -> None:
    """Start-up refusals, by name, for what the chosen KV storage does not cover."""
    name = config.kv_cache_dtype
    if name != "auto" and device.type == "cuda" and run_dtype != torch.float16:
        # The CUDA attention kernels (and the one-byte formats' write and widening) take
        # float16 only.
        raise startup.StartupError(
            f"--kv-cache-dtype {name} with --dtype {config.dtype} ({run_dtype}) on CUDA: the "
            "attention kernels need the float16 run dtype"
        )


def workspace(kv_cache_dtype: str, run_dtype: torch.dtype, device) -> KVWorkspace | None:
    """The widening workspace of a one-byte format (None for auto / fp16: nothing to widen)."""
    if fp8_format(kv_cache_dtype) is None:
        return None
    return KVWorkspace(run_dtype, torch.device(device))


# Scales are by layer index: the MTP layers' names (mtp.layers.N) would collide with the
# target's own layers.
_NOT_TARGET = ("mtp.",)


def read_kv_scales(model_dir: str | Path) -> dict[int, dict[str, float]]:
    """{layer: {"k": scale, "v": scale}} of the k_scale / v_scale tensors a safetensors
    checkpoint ships (empty for a GGUF file or a checkpoint without them)."""
    if is_gguf(model_dir):
        return {}
    out: dict[int, dict[str, float]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = _SCALE_NAME.search(key)
                if m is None or key.startswith(_NOT_TARGET):
                    continue
                which = m[2] or m[3] or m[4]
                t = st.get_tensor(key)
                if t.numel() != 1:
                    raise startup.StartupError(
                        f"{path.name}: {key} has {t.numel()} elements; only a per-layer "
                        "(one-element) KV scale is supported"
                    )
                value = float(t.float().item())
                if not value > 0 or value == float("inf"):
                    raise startup.StartupError(f"{path.name}: {key} = {value} is not positive")
                out.setdefault(int(m[1]), {})[which] = value
    return out


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def install(
    model: torch.nn.Module,
    kv_cache_dtype: str,
    scales_dir: str | Path | None,
    ws: KVWorkspace | None,
    what: str = "KV cache",
) -> None:
    """Give every attention layer of `model` (each module with a `kv_quant` attribute, under
    `layers.N`) its KVQuant (nothing for auto / fp16), with e4m3 scales from the safetensors in
    scales_dir (None: 1.0 for every layer), all widening into `ws`, and state the format and the
    scales' origin once in the log."""
    fmt = fp8_format(kv_cache_dtype)
    if fmt is None:
        return
    assert ws is not None, "a one-byte KV cache needs its widening workspace"
    scales = read_kv_scales(scales_dir) if fmt == fp8.E4M3 and scales_dir is not None else {}
    n = 0
    for name, module in model.named_modules():
        if not hasattr(module, "kv_quant"):
            continue
        m = _LAYER.search(name)
        s = scales.get(int(m[1]), {}) if m is not None else {}
        module.kv_quant = KVQuant(fmt, s.get("k", 1.0), s.get("v", 1.0), ws)
        n += 1
    if fmt == fp8.E5M2:
        logger.info("%s: fp8_e5m2 (one byte per element, no scale)", what)
    elif scales:
        logger.info(
            "%s: fp8_e4m3 with the checkpoint's k_scale / v_scale (%d of %d layers; 1.0 for "
            "the others)",
            what,
            len(scales),
            n,
        )
    elif scales_dir is None:
        logger.info("%s: fp8_e4m3, scale 1.0", what)
    else:
        logger.info("%s: fp8_e4m3, scale 1.0 (the checkpoint has no k_scale / v_scale)", what)


def install_proposer(proposer, kv_cache_dtype: str, ws: KVWorkspace | None) -> None:
    """A proposer's own model (a draft model, an EAGLE head, the MTP layers) keeps its KV cache
    in the target's format; nothing for a proposer without a model (n-gram)."""
    draft = getattr(proposer, "draft", None)
    if draft is not None:
        install(draft.model, kv_cache_dtype, proposer.kv_scales_dir, ws, "proposer's KV cache")
