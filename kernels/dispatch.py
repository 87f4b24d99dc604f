"""The one place that picks, per op, the torch reference or the numba.cuda launcher.

On CPU every op is its torch reference (`*_ref` in the kernel family's file). On CUDA an op uses
the launcher `<op>_cuda` when its kernel file defines one; launchers are looked up by name with
getattr, so a kernel that lands later needs no change here. A launcher takes the same arguments
as its reference and has the same effect (returns the same thing, or writes the same tensors in
place). `VOLTSERVE_FORCE_REF=1` (or `force_ref=True`) keeps every op on the reference, which is how
GPU tests compare the two. A few ops have their own switch (`Op.env`): `VOLTSERVE_GEMV=0` keeps
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
from voltserve.kernels import registry

logger = logging.getLogger(__name__)

FORCE_REF_ENV = "VOLTSERVE_FORCE_REF"

# Every op, its reference, its launcher modules and when the launcher serves: the families'
# tables (kernels/registry.py).
_OPS = registry.ops()

# What a decode step runs inside a captured graph (sampling stays outside).
DECODE_GRAPH_OPS = tuple(name for name, op in _OPS.items() if op.decode_graph)


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"voltserve.kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"voltserve.kernels.{name}":
            raise  # the kernel file exists but one of its own imports failed: say so
        return None


def _dtypes(names: tuple[str, ...] | None) -> tuple[torch.dtype, ...] | None:
    return None if names is None else tuple(getattr(torch, n) for n in names)


def reference(op: str) -> Callable:
    """The torch reference of `op` (what every op runs on CPU)."""
    spec = _OPS[op]
    return getattr(_module(spec.reference_module), spec.reference_name)


def force_ref_from_env() -> bool:
    return os.environ.get(FORCE_REF_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def op_disabled_by_env(op: str) -> bool:
    name = _OPS[op].env if op in _OPS else None
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
        for op, spec in _OPS.items():
            fn, kind = None, "ref"
            if use_cuda and not op_disabled_by_env(op):
                for fam in spec.launchers:
                    mod = _module(fam)
                    fn = getattr(mod, f"{op}_cuda", None) if mod is not None else None
                    ok = getattr(mod, f"{op}_cuda_dtypes", None) or _dtypes(spec.cuda_dtypes)
                    if fn is not None and ok is not None and dtype not in ok:
                        fn = None
                    if fn is not None and block_size not in (spec.block_sizes or (block_size,)):
                        fn = None
                    if fn is not None:
                        kind = "cuda"
                        break
            if fn is None and graph_torch_fallback and self.device.type == "cuda":
                fn = _CAPTURABLE_FALLBACKS.get(op)
                kind = "torch-capturable" if fn is not None else "ref"
            if fn is None:
                fn = reference(op)
            self._fns[op] = fn
            self.impl[op] = kind
            setattr(self, op, fn)
        logger.debug("kernel dispatch on %s: %s", self.device, self.impl)

    def capturable(self, ops: tuple[str, ...] = DECODE_GRAPH_OPS) -> bool:
        """True when every op in `ops` can be captured in a CUDA graph."""
        return all(self.impl[op] != "ref" or _OPS[op].capturable_ref for op in ops)

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
    reshape_and_cache_fp8: Callable[..., None]
    expand_kv_pages: Callable[..., None]
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
    causal_conv1d_verify: Callable[..., torch.Tensor]
    gated_delta_rule_verify: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Group-quantized weights. The weight formats' linear and expert methods
# (services/executor/quant/) reach their kernels only through these, so this file stays the one
# place that picks kernels. Which quantized kernel serves a row count is the launcher's own rule
# (linear/quant_linear.quant_path), as the flash-or-CUDA-core choice is prefill_fa's; each entry
# here runs its reference where impl["quant_linear"] (or, for experts, impl["moe_experts"]) is
# not "cuda".


def quant_linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None, ops: Any) -> torch.Tensor:
    """y = x[:, perm] @ dequantize(w)^T (+ bias) for 2-D x; ops None: the reference."""
    from voltserve.kernels.linear import quant_linear as q

    return q.quant_linear(x, w, bias, ops)


def quant_gate_up_silu(
    x: torch.Tensor, w: Any, bias: torch.Tensor | None, ops: Any
) -> torch.Tensor:
    """silu_and_mul of a merged gate_up quantized linear (one fused launch for decode rows)."""
    from voltserve.kernels.linear import quant_linear as q

    return q.quant_gate_up_silu(x, w, bias, ops)


def quant_qkv_rope(x: torch.Tensor, w: Any, bias: torch.Tensor | None, ops: Any, *args: Any):
    """The quantized qkv projection with rotary and the KV-cache write (quant_linear.py)."""
    from voltserve.kernels.linear import quant_linear as q

    return q.quant_qkv_rope(x, w, bias, ops, *args)


def fp4_linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None, ops: Any) -> torch.Tensor:
    """y = x @ dequantize_fp4(w)^T (+ bias) for 2-D x, FP4 weights (NVFP4, MXFP4); the
    integer formats' switch (impl["quant_linear"]) picks kernels or the reference."""
    from voltserve.kernels.linear import fp4_linear as f

    return f.fp4_linear(x, w, bias, ops)


def fp4_gate_up_silu(x: torch.Tensor, w: Any, bias: torch.Tensor | None, ops: Any) -> torch.Tensor:
    """silu_and_mul of a merged gate_up FP4 linear (one fused launch for decode rows)."""
    from voltserve.kernels.linear import fp4_linear as f

    return f.fp4_gate_up_silu(x, w, bias, ops)


def kquant_linear(x: torch.Tensor, segs: Any, bias: torch.Tensor | None, ops: Any) -> torch.Tensor:
    """y = x @ W^T (+ bias) for 2-D x, GGUF K-quant weights in their block bytes (a list of
    kquant_pack.KQuantSegment); the integer formats' switch (impl["quant_linear"]) picks kernels
    or the reference."""
    from voltserve.kernels.linear import kquant_linear as kq

    return kq.kquant_linear(x, segs, bias, ops)


def kquant_gate_up_silu(x: torch.Tensor, segs: Any, bias: torch.Tensor | None, ops: Any):
    """silu_and_mul of a merged gate_up K-quant linear."""
    from voltserve.kernels.linear import kquant_linear as kq

    return kq.kquant_gate_up_silu(x, segs, bias, ops)


def reserve_quant_scratch(ops: Any, numel: int) -> None:
    """The dequantize path's scratch for weights of up to numel elements, before graph capture."""
    from voltserve.kernels.linear import quant_linear as q

    q.reserve_scratch(ops, numel)


def dequantize(w: Any, kernel: bool) -> torch.Tensor:
    """The [N, K] float weight of a group-quantized one: the one-pass CUDA kernel
    (linear/quant_dequant.py) when `kernel` and it takes w, else the reference rule (the same
    values: the kernel is tested against it)."""
    from voltserve.kernels.linear import quant_pack

    if kernel and w.qweight.is_cuda:
        from voltserve.kernels.linear import quant_dequant

        out = torch.empty((w.out_features, w.in_features), dtype=w.dtype, device=w.qweight.device)
        if quant_dequant.supports(w, out):
            return quant_dequant.dequantize_into(w, out)
    return quant_pack.dequantize(w)


def quant_experts_decode(
    ops: Any, x: torch.Tensor, k: int, num_experts: int
) -> Callable[..., torch.Tensor] | None:
    """The fused quantized-experts launcher (moe/quant_decode.py) when it serves this step's
    tokens (behind the fp16 experts' switch, impl["moe_experts"]), else None. The caller checks
    the weights with `quant_experts_take`."""
    from voltserve.kernels.moe import quant_decode as mq

    if ops is None or ops.impl.get("moe_experts") != "cuda":
        return None
    if not mq.fused_pays(x.shape[0], k, num_experts):
        return None
    return mq.moe_quant_decode


def quant_experts_flat(qweight, scales, offsets, w0: Any) -> Any:
    """A layer's stacked experts as the one flat weight the fused launcher reads."""
    from voltserve.kernels.moe import quant_decode as mq

    return mq.flat_experts(qweight, scales, offsets, w0)


def quant_experts_take(x: torch.Tensor, w13: Any, w2: Any, k: int) -> bool:
    """Whether the fused launcher takes these flat weights for x."""
    from voltserve.kernels.moe import quant_decode as mq

    return mq.supports(x, w13, w2, k)


def fp4_experts_decode(
    ops: Any,
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """The fused FP4 experts (moe/fp4_decode.py) on flat FP4 weights when they serve this step
    (behind the fp16 experts' switch, impl["moe_experts"]), else None: the caller dequantizes."""
    if ops is None or ops.impl.get("moe_experts") != "cuda":
        return None
    from voltserve.kernels.moe import fp4_decode as mf

    if not mf.supports(x, w13, w2, topk_ids.shape[1]):
        return None
    return mf.moe_fp4_decode(x, w13, w2, topk_weights, topk_ids)


def fp4_experts_flat(packed, scales, gscale, group_size: int, scale_kind: str) -> Any:
    """A layer's stacked FP4 experts as the one flat weight the fused launcher reads."""
    from voltserve.kernels.moe import fp4_decode as mf

    return mf.flat_experts(packed, scales, gscale, group_size, scale_kind)


def fp4_dequantize(w: Any, dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """The [N, K] float weight of an FP4 one in dtype: the dequantize kernel
    (linear/fp4_kernels.py) when `kernel` and it takes w, else fp4_pack.dequantize_fp4 (the same
    values: the kernel is tested against it)."""
    from voltserve.kernels.linear import fp4_linear, fp4_pack
    from voltserve.kernels.runtime.launch_geometry import on_gpu

    if kernel and on_gpu(w.packed):
        out = torch.empty(w.shape, dtype=dtype, device=w.packed.device)
        return fp4_linear.dequantize_into(w, out)
    return fp4_pack.dequantize_fp4(w, dtype)


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
