"""The one place that picks, per op, the torch reference or the numba.cuda launcher.

On CPU every op is its torch reference (`*_ref` in the kernel family's file). On CUDA an op uses
the launcher `<op>_cuda` when its kernel file defines one; launchers are looked up by name with
getattr, so a kernel that lands later needs no change here. A launcher takes the same arguments
as its reference and has the same effect (returns the same thing, or writes the same tensors in
place). `VOLTSERVE_FORCE_REF=1` (or `force_ref=True`) keeps every op on the reference, which is how
GPU tests compare the two. A few ops have their own switch (`_OP_ENV`): `VOLTSERVE_GEMV=0` keeps
the decode linears on cuBLAS, to compare the two end to end.

CUDA graphs: a captured step may not synchronise with the host. The references for
reshape_and_cache and the paged attentions do (boolean masks, `.tolist()`), so they cannot be
captured. For graph decode without numba kernels, `graph_torch_fallback=True` swaps in
vectorised torch versions that never sync: `_reshape_and_cache_capturable` writes padding rows
(slot -1) into the cache's last slot, so the caller must allocate one scratch block past the
blocks it hands out; `_paged_decode_attention_capturable` reads the whole block table width.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORCE_REF_ENV = "VOLTSERVE_FORCE_REF"

# op -> (kernel modules searched for `<op>_cuda`, in order; module and name of the reference).
# Modules are dotted paths inside voltserve.kernels (subpackage.file).
_OPS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "rms_norm": (("elementwise.rmsnorm",), "elementwise.rmsnorm", "rms_norm_ref"),
    "fused_add_rms_norm": (
        ("elementwise.rmsnorm",),
        "elementwise.rmsnorm",
        "fused_add_rms_norm_ref",
    ),
    "rotary_embedding": (("attention.rotary",), "attention.rotary", "rotary_embedding_ref"),
    "silu_and_mul": (("elementwise.activation",), "elementwise.activation", "silu_and_mul_ref"),
    "reshape_and_cache": (("attention.kv_cache",), "attention.kv_cache", "reshape_and_cache_ref"),
    # rotary_embedding then reshape_and_cache in one launch (what the models call).
    "rotary_and_cache": (
        ("attention.rotary_cache",),
        "attention.rotary_cache",
        "rotary_and_cache_ref",
    ),
    # Per-head q/k RMSNorm, then rotary_and_cache, in one launch (q/k-norm models: Qwen3).
    "qk_norm_rope_and_cache": (
        ("attention.qk_norm_rope",),
        "attention.qk_norm_rope",
        "qk_norm_rope_and_cache_ref",
    ),
    # prefill_attention_fa.paged_attention_cuda: the flash kernel where it covers the shape
    # (head dims 64 and 128), the CUDA-core kernel of attention/prefill.py otherwise.
    "paged_attention": (
        (
            "attention.prefill_fa",
            "attention.prefill",
            "attention.ref",
        ),
        "attention.ref",
        "paged_attention_ref",
    ),
    "paged_decode_attention": (
        ("attention.decode", "attention.ref"),
        "attention.ref",
        "paged_decode_attention_ref",
    ),
    # Linears of up to 8 rows (decode); models/layers.py calls it only for such inputs.
    "gemv": (("linear.gemv",), "linear.gemv", "gemv_ref"),
    # The gate_up projection with silu_and_mul fused into its output (out = the activation).
    "gemv_gate_up": (("linear.gemv",), "linear.gemv", "gemv_gate_up_ref"),
    # The qkv projection with rotary and the KV-cache write fused into its output (decode).
    "gemv_qkv_rope": (("linear.gemv_qkv_rope",), "linear.gemv_qkv_rope", "gemv_qkv_rope_ref"),
    # MoE: the router's top-k (torch on the device, capturable) and the routed experts
    # (fused decode kernels for <= 8 tokens, grouped GEMMs beyond).
    "moe_topk": (("moe.routing",), "moe.routing", "moe_topk_ref"),
    "moe_experts": (("moe.experts",), "moe.experts", "moe_experts_ref"),
    # Linears with group-quantized weights (quant_linear.py picks the kernel by row count; the
    # model calls quant_linear.quant_linear(x, w, bias, ops), which reads impl["quant_linear"]).
    "quant_linear": (("linear.quant_linear",), "linear.quant_linear", "quant_linear_ref"),
    "apply_penalties": (("sampling.sampling",), "sampling.sampling", "apply_penalties_ref"),
    "sample": (("sampling.sampling",), "sampling.sampling", "sample_ref"),
    # Structured outputs: -inf where the grammar's bitmask forbids a token (masked rows only).
    "apply_token_bitmask": (
        ("sampling.grammar_mask",),
        "sampling.grammar_mask",
        "apply_token_bitmask_ref",
    ),
    # Gated DeltaNet (linear attention) layers: states in slot-indexed pools (see
    # linear_attention/__init__.py). Dotted names: files of the linear_attention subpackage.
    "causal_conv1d_prefill": (
        ("linear_attention.conv",),
        "linear_attention.conv",
        "causal_conv1d_prefill_ref",
    ),
    "causal_conv1d_decode": (
        ("linear_attention.conv",),
        "linear_attention.conv",
        "causal_conv1d_decode_ref",
    ),
    "gated_delta_rule_prefill": (
        ("linear_attention.chunk",),
        "linear_attention.chunk",
        "gated_delta_rule_prefill_ref",
    ),
    "gated_delta_rule_decode": (
        ("linear_attention.recurrent",),
        "linear_attention.recurrent",
        "gated_delta_rule_decode_ref",
    ),
    "gated_rms_norm": (
        ("linear_attention.gated_norm",),
        "linear_attention.gated_norm",
        "gated_rms_norm_ref",
    ),
}

# Storage dtypes a launcher handles unless its module says otherwise with `<op>_cuda_dtypes`
# (numba has no bf16 arrays). An op whose launcher cannot take the model's dtype uses the reference.
_DEFAULT_CUDA_DTYPES = (torch.float16, torch.float32)
_CUDA_DTYPES: dict[str, tuple[torch.dtype, ...] | None] = {
    "paged_attention": (torch.float16,),
    "paged_decode_attention": (torch.float16,),
    # Sampling works on fp32 logits whatever the model's dtype.
    "apply_penalties": None,
    "sample": None,
    "apply_token_bitmask": None,
}
# The attention kernels are written for 16-token KV blocks.
_CUDA_BLOCK_SIZES: dict[str, tuple[int, ...]] = {
    "paged_attention": (16,),
    "paged_decode_attention": (16,),
}

# Ops with their own off switch: the env var set to 0/false/no/off keeps the op on its reference.
_OP_ENV: dict[str, str] = {
    "gemv": "VOLTSERVE_GEMV",
    "gemv_gate_up": "VOLTSERVE_GEMV",
    "gemv_qkv_rope": "VOLTSERVE_GEMV",
    # Off: the q/k-norm models run rms_norm twice and rotary_and_cache (the separate kernels).
    "qk_norm_rope_and_cache": "VOLTSERVE_QK_NORM_ROPE",
    "moe_topk": "VOLTSERVE_MOE_TOPK",
    "quant_linear": "VOLTSERVE_QUANT_KERNELS",
}

# References that never synchronise with the host, so a CUDA graph can capture them.
_CAPTURABLE_REFS = {
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gemv",
    "gemv_gate_up",
    "moe_topk",
    "quant_linear",
}
# What a decode step runs inside a captured graph (sampling stays outside).
DECODE_GRAPH_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "reshape_and_cache",
    "rotary_and_cache",
    "paged_decode_attention",
)
# Not listed: qk_norm_rope_and_cache. The model calls it only where it is the kernel (capturable)
# or where rms_norm and rotary_and_cache are of its own kind (qk_norm_rope.covers), so those two
# decide; with VOLTSERVE_QK_NORM_ROPE=0 it is a reference the model never calls.


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"voltserve.kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"voltserve.kernels.{name}":
            raise  # the kernel file exists but one of its own imports failed: say so
        return None


def force_ref_from_env() -> bool:
    return os.environ.get(FORCE_REF_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def op_disabled_by_env(op: str) -> bool:
    name = _OP_ENV.get(op)
    return name is not None and os.environ.get(name, "").strip().lower() in (
        "0",
        "false",
        "no",
        "off",
    )


class KernelDispatch:
    """Resolves every op once, at construction, for one device and model dtype."""

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype = torch.float16,
        block_size: int = 16,
        force_ref: bool | None = None,
        graph_torch_fallback: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.force_ref = force_ref_from_env() if force_ref is None else force_ref
        self.impl: dict[str, str] = {}  # op -> "cuda" | "ref" | "torch-capturable"
        # Which decode linears run ops.gemv / ops.gemv_gate_up rather than cuBLAS, per weight shape
        # and row count: a LinearPlan (services/executor/linear_plan.py) the runner sets before
        # graph capture. None: every linear of <= 8 rows runs ops.gemv, MLPs stay unfused.
        self.linear_plan: Any = None
        # The dequantize path's reused weight buffer (quant_linear.QuantScratch), made on first use.
        self.quant_scratch: Any = None
        self._fns: dict[str, Callable] = {}
        use_cuda = self.device.type == "cuda" and not self.force_ref
        for op, (families, ref_mod, ref_name) in _OPS.items():
            fn, kind = None, "ref"
            if use_cuda and not op_disabled_by_env(op):
                for fam in families:
                    mod = _module(fam)
                    fn = getattr(mod, f"{op}_cuda", None) if mod is not None else None
                    ok = getattr(mod, f"{op}_cuda_dtypes", None) or _CUDA_DTYPES.get(
                        op, _DEFAULT_CUDA_DTYPES
                    )
                    if fn is not None and ok is not None and dtype not in ok:
                        fn = None
                    if fn is not None and block_size not in _CUDA_BLOCK_SIZES.get(
                        op, (block_size,)
                    ):
                        fn = None
                    if fn is not None:
                        kind = "cuda"
                        break
            if fn is None and graph_torch_fallback and self.device.type == "cuda":
                fn = _CAPTURABLE_FALLBACKS.get(op)
                kind = "torch-capturable" if fn is not None else "ref"
            if fn is None:
                fn = getattr(_module(ref_mod), ref_name)
            self._fns[op] = fn
            self.impl[op] = kind
            setattr(self, op, fn)
        logger.debug("kernel dispatch on %s: %s", self.device, self.impl)

    def capturable(self, ops: tuple[str, ...] = DECODE_GRAPH_OPS) -> bool:
        """True when every op in `ops` can be captured in a CUDA graph."""
        return all(self.impl[op] != "ref" or op in _CAPTURABLE_REFS for op in ops)

    # Typed aliases so callers get signatures; the attributes set above shadow these.
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., None]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    rotary_and_cache: Callable[..., None]
    qk_norm_rope_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    gemv: Callable[..., torch.Tensor]
    gemv_gate_up: Callable[..., torch.Tensor]
    apply_token_bitmask: Callable[..., None]
    gemv_qkv_rope: Callable[..., torch.Tensor]
    moe_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    moe_experts: Callable[..., torch.Tensor]
    quant_linear: Callable[..., torch.Tensor]
    apply_penalties: Callable[..., None]
    sample: Callable[..., torch.Tensor]
    causal_conv1d_prefill: Callable[..., torch.Tensor]
    causal_conv1d_decode: Callable[..., torch.Tensor]
    gated_delta_rule_prefill: Callable[..., torch.Tensor]
    gated_delta_rule_decode: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]


def _reshape_and_cache_capturable(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # Negative slots go to the last slot of the last (scratch) block instead of being skipped:
    # skipping needs a data-dependent shape, which a graph cannot hold.
    num_blocks, _, block_size, _ = k_cache.shape
    slots = torch.where(slot_mapping >= 0, slot_mapping, num_blocks * block_size - 1).long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value.to(v_cache.dtype)


def _rotary_and_cache_capturable(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # rotary_and_cache_ref's meaning; its cache write syncs (boolean mask), this one never does.
    from voltserve.kernels.attention.rotary import rotary_embedding_ref

    rotary_embedding_ref(positions, q, k, head_dim, cos_sin_cache, is_neox)
    T, kv_heads = k.shape[0], k_cache.shape[1]
    _reshape_and_cache_capturable(
        k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim), k_cache, v_cache, slot_mapping
    )


def _qk_norm_rope_and_cache_capturable(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # qk_norm_rope_and_cache_ref's meaning, with the never-syncing cache write.
    from voltserve.kernels.attention.qk_norm_rope import _norm_heads

    kn = _norm_heads(k, k_weight, eps, head_dim)
    q.copy_(_norm_heads(q, q_weight, eps, head_dim))
    _rotary_and_cache_capturable(
        positions, q, kn, v, head_dim, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping
    )


def _paged_decode_attention_capturable(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    B, H, D = q.shape
    _, kvh, bs, _ = k_cache.shape
    W = block_tables.shape[1]
    bt = block_tables.long()
    # [B, W, kvh, bs, D] -> [B, kvh, W*bs, D]
    k = k_cache[bt].permute(0, 2, 1, 3, 4).reshape(B, kvh, W * bs, D).float()
    v = v_cache[bt].permute(0, 2, 1, 3, 4).reshape(B, kvh, W * bs, D).float()
    qg = q.float().view(B, kvh, H // kvh, D)
    scores = torch.einsum("bkgd,bksd->bkgs", qg, k) * scale
    pos = torch.arange(W * bs, device=q.device)
    mask = pos[None, :] >= seq_lens.long()[:, None]  # [B, S]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bksd->bkgd", probs, v)
    return out.reshape(B, H, D).to(q.dtype)


_CAPTURABLE_FALLBACKS: dict[str, Callable] = {
    "reshape_and_cache": _reshape_and_cache_capturable,
    "rotary_and_cache": _rotary_and_cache_capturable,
    "qk_norm_rope_and_cache": _qk_norm_rope_and_cache_capturable,
    "paged_decode_attention": _paged_decode_attention_capturable,
}
