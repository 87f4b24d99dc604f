"""The MoE experts op: out[t] = sum_slot w[t, slot] * expert_e(x[t]) with e = topk_ids[t, slot]
and expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)).

Experts are stored stacked per layer, the way the kernels read them: w13 [E, 2I, H] (each
expert's gate rows, then its up rows: the merged gate_up layout of the dense MLP) and
w2 [E, H, I].

Rounding (the reference defines it): gate and up are rounded to the storage dtype as a linear
stores them, the activation as silu_and_mul rounds it; the down projection, the routing weight
and the sum over the k slots are fp32, rounded once to the storage dtype at the end.

On CUDA (`moe_experts_cuda`): T <= 8 tokens run the fused decode kernels (moe/decode.py: only
each token's k experts are read), more run the grouped GEMMs: on tensor cores for fp16
(moe/wmma.py; 2.0x / 2.2x faster than the CUDA-core kernels at batch 64 / 256 on the
Qwen3-30B-A3B shape, BENCHMARKS.md), on CUDA cores otherwise (moe/grouped.py: fp32, or fp16
with VOLTSERVE_MOE_WMMA=0). Neither syncs with the host, so both sit inside the decode CUDA
graphs. What they cannot take (bf16, rows not 16-byte aligned, H or I not a multiple of 8) runs
the reference, which syncs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.runtime.launch_geometry import on_gpu


def moe_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int
) -> torch.Tensor:
    """[T, H] in x's dtype. Loops over the experts that received tokens (syncs with the host:
    the CPU path and the definition the kernels are tested against)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).long()
    wflat = topk_weights.reshape(-1).float()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start : start + c]
        start += c
        tok = pairs // k
        h = silu_and_mul_ref(F.linear(x[tok], w13[e]))
        y = F.linear(h.float(), w2[e].float())
        out.index_add_(0, tok, y * wflat[pairs, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# CUDA

moe_experts_cuda_dtypes = (torch.float16, torch.float32)
WMMA_ENV = "VOLTSERVE_MOE_WMMA"  # 0: fp16 grouped GEMMs on CUDA cores (moe/grouped.py)


def wmma_enabled() -> bool:
    """Read at each call (cheap), so the decode graphs bake in what was set at capture."""
    return os.environ.get(WMMA_ENV, "").strip().lower() not in ("0", "false", "no", "off")


DECODE_MAX_TOKENS = 8  # up to this many tokens: the fused decode kernels


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True when the kernels cover these tensors (else the reference runs)."""
    return (
        on_gpu(x)
        and x.dim() == 2
        and w13.dim() == 3
        and w2.dim() == 3
        and x.dtype == w13.dtype == w2.dtype
        and x.dtype in moe_experts_cuda_dtypes
        and x.shape[1] == w13.shape[2] == w2.shape[1]
        and w13.shape[1] == 2 * w2.shape[2]
        and x.shape[1] % 8 == 0
        and w2.shape[2] % 8 == 0
        and _aligned(x)
        and _aligned(w13)
        and _aligned(w2)
    )


def moe_experts_cuda(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as moe_experts_ref; no host sync for what `supports` accepts."""
    if not supports(x, w13, w2) or x.shape[0] == 0:
        return moe_experts_ref(x, w13, w2, topk_weights, topk_ids)
    wts = topk_weights.float().contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    if x.shape[0] <= DECODE_MAX_TOKENS:
        from voltserve.kernels.moe.decode import moe_decode

        return moe_decode(x, w13, w2, wts, ids)
    if wmma_enabled():
        from voltserve.kernels.moe import wmma as moe_wmma

        if moe_wmma.supports(x, w13, w2):
            return moe_wmma.moe_wmma(x, w13, w2, wts, ids)
    from voltserve.kernels.moe.grouped import moe_grouped

    return moe_grouped(x, w13, w2, wts, ids)


__all__ = ["moe_experts_ref", "moe_experts_cuda", "supports", "DECODE_MAX_TOKENS"]
