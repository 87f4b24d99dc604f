"""The decode GEMVs with the residual add and RMSNorm folded in (opt-in: VOLTSERVE_FUSE_NORM=1).

A decoder layer at batch 1 runs two fused add + RMSNorm launches (~3.1 us each on an H200, 0.20
ms of a ~4.5 ms Llama-3-8B step) between its linears. Here they disappear into the GEMVs:

- `gemv_residual`: o_proj and down_proj add their product to the residual stream themselves
  (residual += x @ w^T, rounded as the linear and then the add round), and add the squares of
  the values they write into `ss`, the rows' sums of squares (fp32 [M, SS_SLOTS], partial sums
  whose total is what counts; zeroed by the caller before);
- `gemv_gate_up_norm` / `gemv_qkv_rope_norm`: gate_up and qkv read the residual stream and
  normalise it as they read it (RMSNorm with the layer's norm weight, rounded as rmsnorm.py
  rounds), taking 1/rms from the `ss` the previous residual GEMV left.

A first version had every warp of the norm GEMVs sum the row's squares itself before its first
weight load: on an H200 the Llama-3-8B step took 4.93 ms with it against 4.74 without. The sums
now come from the epilogue that writes the row, one float per lane to read.

Meanings (the references): the unfused ops in sequence, see each `_ref`; the rms comes from ss
(its total over the slots), so it equals rmsnorm.py's when ss holds the row's sum of squares.
Rounding can differ in the last bit: the sum is taken in a different order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.gemv import (
    GATE_UP,
    PLAIN,
    SS_SLOTS,
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

gemv_residual_cuda_dtypes = (torch.float16, torch.float32)
gemv_gate_up_norm_cuda_dtypes = gemv_residual_cuda_dtypes
gemv_qkv_rope_norm_cuda_dtypes = gemv_residual_cuda_dtypes


def new_sums_of_squares(count: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """`count` zeroed sums of squares for `rows` rows of the residual stream: fp32 [count, rows,
    SS_SLOTS] (each [i] is what one gemv_residual adds to and one norm GEMV reads)."""
    return torch.zeros((count, rows, SS_SLOTS), dtype=torch.float32, device=device)


def rms_norm_from_ss_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, ss: torch.Tensor
) -> torch.Tensor:
    """rms_norm_ref(x, weight, eps) with each row's sum of squares taken from ss (its total)."""
    inv = torch.rsqrt(ss.float().sum(-1, keepdim=True) / x.shape[-1] + eps)
    return weight * (x.float() * inv).to(x.dtype)


def gemv_residual_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ss: torch.Tensor,
) -> torch.Tensor:
    """residual += x @ w^T (+ bias), in place (the product rounded to the storage dtype first, as
    the linear stores it), and ss[m] gains the sum of squares of residual row m's new values
    (into its first slot); returns residual. Never syncs with the host."""
    residual.add_(F.linear(x, w, bias))
    ss[:, 0] += residual.float().square().sum(-1)
    return residual


def gemv_gate_up_norm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    ss: torch.Tensor,
) -> torch.Tensor:
    """gemv_gate_up_ref(rms_norm_from_ss_ref(x, norm_weight, eps, ss), w, bias): [M, I]."""
    return gemv_gate_up_ref(rms_norm_from_ss_ref(x, norm_weight, eps, ss), w, bias)


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
    ss: torch.Tensor,
) -> torch.Tensor:
    """gemv_qkv_rope_ref on rms_norm_from_ss_ref(x, norm_weight, eps, ss) (cache writes
    included)."""
    xn = rms_norm_from_ss_ref(x, norm_weight, eps, ss)
    return gemv_qkv_rope_ref(
        xn, w, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv
    )


def _ss_ok(x: torch.Tensor, ss: torch.Tensor) -> bool:
    return (
        ss.shape == (x.shape[0], SS_SLOTS)
        and ss.dtype == torch.float32
        and ss.is_cuda
        and ss.is_contiguous()
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
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ss: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gemv_residual_ref; one launch, no host sync (graph-capturable)."""
    M, N = x.shape[0], w.shape[0]
    ok = (
        supports(x, w)
        and residual.shape == (M, N)
        and residual.dtype == x.dtype
        and residual.stride(-1) == 1
        and _ss_ok(x, ss)
    )
    if not ok:
        return gemv_residual_ref(x, w, bias, residual, ss)
    return launch_gemv(x, w, bias, residual, PLAIN, res_ss=ss)


def gemv_gate_up_norm_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    ss: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gemv_gate_up_norm_ref; one launch, no host sync."""
    if not (supports_gate_up(x, w) and _norm_ok(x, norm_weight) and _ss_ok(x, ss)):
        return gemv_gate_up_norm_ref(x, w, bias, norm_weight, eps, ss)
    return launch_gemv(x, w, bias, None, GATE_UP, norm=(norm_weight, eps, ss))


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
    ss: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gemv_qkv_rope_norm_ref; one launch, no host sync."""
    rope = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)
    if not (supports_qkv_rope(x, w, *rope) and _norm_ok(x, norm_weight) and _ss_ok(x, ss)):
        return gemv_qkv_rope_norm_ref(x, w, bias, *rope, norm_weight, eps, ss)
    return launch_qkv_rope(x, w, bias, rope, norm=(norm_weight, eps, ss))
