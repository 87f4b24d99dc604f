"""Rotary embedding and the KV-cache write in one launch.

Decode at small batch is launch bound: rotary_embedding and reshape_and_cache are two tiny
kernels per layer. This op does both: q and k rotate in place (rotary.py's meaning, partial
rotary and both styles included) and the rotated k, with v, lands in the paged cache
(kv_cache.py's layout; slot -1 = padding row, skipped).
"""

from __future__ import annotations

import torch
from voltserve.kernels.attention.kv_cache import (
    cache_row,
    reshape_and_cache_cuda,
    reshape_and_cache_ref,
)
from voltserve.kernels.attention.rotary import (
    rotary_args,
    rotary_embedding_cuda,
    rotary_embedding_ref,
    rotate_row,
)


def rotary_and_cache_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads * head_dim] (row views of the fused qkv output are fine)
    k: torch.Tensor,  # [T, num_kv_heads * head_dim]
    v: torch.Tensor,  # [T, num_kv_heads * head_dim]
    head_dim: int,
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    is_neox: bool,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip
) -> None:
    """rotary_embedding_ref on q and k (in place), then reshape_and_cache_ref of k and v."""
    rotary_embedding_ref(positions, q, k, head_dim, cos_sin_cache, is_neox)
    T, kv_heads = k.shape[0], k_cache.shape[1]
    reshape_and_cache_ref(
        k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim), k_cache, v_cache, slot_mapping
    )


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: one block per token. The block rotates its row of q and k (rotary.rotate_row),
# waits at a barrier so every thread sees the whole rotated row, then copies k and v into the
# cache (kv_cache.cache_row). k arrives twice, as the [T, kv_heads * head_dim] rows rotary walks
# and as the [T, kv_heads, head_dim] view the cache copy walks: the same memory (numba marks no
# kernel argument noalias, and the barrier orders the writes before the reads).

from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import current_stream, launch  # noqa: E402
from voltserve.kernels.runtime.vec_io import vec_ok  # noqa: E402

BLOCK = 128


@cached
@cuda.jit
def rotary_and_cache_kernel(
    positions,
    q,
    k,
    head_dim,
    cos_sin_cache,
    is_neox,
    vec_rot,
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    vec_cache,
):
    t = cuda.blockIdx.x
    rotate_row(t, positions[t], q, k, head_dim, cos_sin_cache, is_neox, vec_rot)
    cuda.syncthreads()  # global writes of this block are visible to all its threads after it
    cache_row(t, slot_mapping[t], key, value, k_cache, v_cache, vec_cache)


def _fusable(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    # What the kernel (and the registered signatures) are written for: one fp16/fp32 storage
    # dtype across q/k/v and the caches, an fp32 cos/sin cache, int64 positions and slots,
    # contiguous caches. Anything else takes the two separate launchers.
    return (
        q.dtype in (torch.float16, torch.float32)
        and all(t.dtype == q.dtype for t in (k, v, k_cache, v_cache))
        and cos_sin_cache.dtype == torch.float32
        and positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def rotary_and_cache_cuda(
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
    """Same meaning as rotary_and_cache_ref, in one launch and without a host sync."""
    T = q.shape[0]
    if not T:
        return
    kv_heads = k_cache.shape[1]
    key, value = k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    if not _fusable(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
        rotary_embedding_cuda(positions, q, k, head_dim, cos_sin_cache, is_neox)
        reshape_and_cache_cuda(key, value, k_cache, v_cache, slot_mapping)
        return
    vec_cache = vec_ok(key, value, k_cache, v_cache)
    launch(
        rotary_and_cache_kernel,
        T,
        BLOCK,
        (
            *rotary_args(positions, q, k, head_dim, cos_sin_cache, is_neox),
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            vec_cache,
        ),
        current_stream(),
    )
