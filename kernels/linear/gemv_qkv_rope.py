"""The decode qkv projection with rotary embedding and the KV-cache write in its epilogue.

At batch 1 the qkv GEMV (~15 us for Llama-3-8B) is followed by a rotary + KV-write launch of
~4 us that is pure latency. Here one GEMV warp owns the two weight rows of a NeoX rotary pair
(dims j and j + D/2 of one head), so when its sums are done it can rotate them itself: q rows are
rotated and written to out, k rows rotated and written to out and to the paged cache, v rows
written to out and to the cache (kernels/linear/gemv.py, kind "qkv_rope").

Meaning: `gemv_qkv_rope_ref`: F.linear, then rotary_cache.rotary_and_cache_ref on the q/k/v row
views of its output, NeoX style. Rounding follows the two ops it replaces: the sums are rounded
to the storage dtype as the linear stores them, then rotated as rotary.py rotates (cos/sin and
every product rounded), so the result matches the unfused kernels up to the GEMV's summation
order. Only full rotary (rotary_dim = head_dim), NeoX style, one storage dtype throughout;
`supports_qkv_rope` says when, and the caller runs the unfused ops otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.attention.rotary_cache import rotary_and_cache_ref
from voltserve.kernels.linear.gemv import QKV_ROPE, launch_gemv, supports


def _views(out: torch.Tensor, n_q: int, n_kv: int, head_dim: int):
    return out.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)


def gemv_qkv_rope_ref(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [(n_q + 2 n_kv) * head_dim, K]
    bias: torch.Tensor | None,
    positions: torch.Tensor,  # [M] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32 (cos | sin)
    k_cache: torch.Tensor,  # [num_blocks, n_kv, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [M] int64; negative = padding row (not written)
    n_q: int,
    n_kv: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv = x @ w^T (+ bias) with q and k rotated (NeoX) in place, k and v written to the cache;
    returns qkv [M, N]. Never syncs with the host (a CUDA graph can capture it)."""
    y = F.linear(x, w, bias)
    if out is None:
        out = y
    else:
        out.copy_(y)
    q, k, v = _views(out, n_q, n_kv, k_cache.shape[3])
    rotary_and_cache_ref(
        positions, q, k, v, k_cache.shape[3], cos_sin_cache, True, k_cache, v_cache, slot_mapping
    )
    return out


gemv_qkv_rope_cuda_dtypes = (torch.float16, torch.float32)


def supports_qkv_rope(
    x: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    n_q: int,
    n_kv: int,
) -> bool:
    """True when the fused kernel computes this step (else run the unfused ops): what `supports`
    needs of x and w, full NeoX rotary over an even head_dim, matching caches of x's dtype, an
    fp32 cos/sin cache, int64 positions and slots with a row per input."""
    M = x.shape[0] if x.dim() == 2 else 0
    return (
        supports(x, w)
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k_cache.shape[1] == n_kv
        and k_cache.shape[3] % 2 == 0
        and w.shape[0] == (n_q + 2 * n_kv) * k_cache.shape[3]
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] == k_cache.shape[3]
        and cos_sin_cache.dtype == torch.float32
        and k_cache.dtype == x.dtype
        and v_cache.dtype == x.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and positions.dim() == 1
        and slot_mapping.dim() == 1
        and positions.shape[0] >= M
        and slot_mapping.shape[0] >= M
    )


def gemv_qkv_rope_cuda(
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning as gemv_qkv_rope_ref; one launch on torch's current stream, no host sync.
    What `supports_qkv_rope` rejects runs the reference."""
    args = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)
    if not supports_qkv_rope(x, w, *args):
        return gemv_qkv_rope_ref(x, w, bias, *args, out=out)
    return launch_qkv_rope(x, w, bias, args, out)


def launch_qkv_rope(x, w, bias, rope_args: tuple, out=None) -> torch.Tensor:
    """One launch of the qkv_rope kernel for inputs its caller checked; rope_args: (positions,
    cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)."""
    positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv = rope_args
    extra = (
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        int(n_q),
        int(n_kv),
    )
    return launch_gemv(x, w, bias, out, QKV_ROPE, extra)
