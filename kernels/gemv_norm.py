"""The decode GEMVs with the residual add and RMSNorm folded in (opt-in: VOLTSERVE_FUSE_NORM=1).

A decoder layer at batch 1 runs two fused add + RMSNorm launches (~3.1 us each on an H200, 0.20
ms of a ~4.8 ms Llama-3-8B step) between its linears. Here they disappear into the GEMVs:

- `gemv_residual`: o_proj and down_proj add their product to the residual stream themselves
  (residual += x @ w^T, rounded as the linear and then the add round);
- `gemv_gate_up_norm` / `gemv_qkv_rope_norm`: gate_up and qkv read the residual stream and
  normalise it as they read it (RMSNorm with the layer's norm weight, rounded as rmsnorm.py
  rounds), each warp first summing the squares of the row itself.

Meanings (the references): the unfused ops in sequence, see each `_ref`. The kernels are the
gemv.py generator's `norm` / `res` options. They pass their GPU tests, but on an H200 the
Llama-3-8B step took 4.93 ms with them against 4.74 without: every warp summing the row's
squares before its first weight load, and normalising each chunk, costs more than the launches
saved. Hence off by default (services/executor/models/llama.py decides where it applies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.gemv import (
    GATE_UP,
    PLAIN,
    gemv_gate_up_ref,
    launch_gemv,
    supports,
    supports_gate_up,
)
from voltserve.kernels.gemv_qkv_rope import (
    gemv_qkv_rope_ref,
    launch_qkv_rope,
    supports_qkv_rope,
)
from voltserve.kernels.rmsnorm import rms_norm_ref

gemv_residual_cuda_dtypes = (torch.float16, torch.float32)
gemv_gate_up_norm_cuda_dtypes = gemv_residual_cuda_dtypes
gemv_qkv_rope_norm_cuda_dtypes = gemv_residual_cuda_dtypes


def gemv_residual_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """residual += x @ w^T (+ bias), in place (the product rounded to the storage dtype first, as
    the linear stores it); returns residual. Never syncs with the host."""
    residual.add_(F.linear(x, w, bias))
    return residual


def gemv_gate_up_norm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """gemv_gate_up_ref(rms_norm_ref(x, norm_weight, eps), w, bias): [M, I]."""
    return gemv_gate_up_ref(rms_norm_ref(x, norm_weight, eps), w, bias)


def gemv_qkv_rope_norm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    n_q: int,
    n_kv: int,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """gemv_qkv_rope_ref on rms_norm_ref(x, norm_weight, eps) (cache writes included)."""
    xn = rms_norm_ref(x, norm_weight, eps)
    return gemv_qkv_rope_ref(
        xn, w, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv
    )


def _norm_ok(x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    return (
        norm_weight.dim() == 1
        and norm_weight.shape[0] == x.shape[1]
        and norm_weight.dtype == x.dtype
        and norm_weight.is_cuda
        and norm_weight.is_contiguous()
        and norm_weight.data_ptr() % 16 == 0
    )


def gemv_residual_cuda(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """Same meaning as gemv_residual_ref; one launch, no host sync (graph-capturable)."""
    M, N = x.shape[0], w.shape[0]
    ok = (
        supports(x, w)
        and residual.shape == (M, N)
        and residual.dtype == x.dtype
        and residual.stride(-1) == 1
    )
    if not ok:
        return gemv_residual_ref(x, w, bias, residual)
    return launch_gemv(x, w, bias, residual, PLAIN, res=True)


def gemv_gate_up_norm_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Same meaning as gemv_gate_up_norm_ref; one launch, no host sync."""
    if not (supports_gate_up(x, w) and _norm_ok(x, norm_weight)):
        return gemv_gate_up_norm_ref(x, w, bias, norm_weight, eps)
    return launch_gemv(x, w, bias, None, GATE_UP, norm=(norm_weight, eps))


def gemv_qkv_rope_norm_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    n_q: int,
    n_kv: int,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Same meaning as gemv_qkv_rope_norm_ref; one launch, no host sync."""
    rope = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)
    if not (supports_qkv_rope(x, w, *rope) and _norm_ok(x, norm_weight)):
        return gemv_qkv_rope_norm_ref(x, w, bias, *rope, norm_weight, eps)
    return launch_qkv_rope(x, w, bias, rope, norm=(norm_weight, eps))
