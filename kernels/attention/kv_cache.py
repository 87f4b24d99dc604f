"""Writing new keys and values into the paged KV cache.

Cache layout (one tensor per layer for K and one for V): [num_blocks, num_kv_heads, block_size,
head_dim]. One KV head's block is contiguous (block_size * head_dim elements), which is what the
decode attention kernel streams. A token's slot is block_id * block_size + offset; a negative
slot (padding in a CUDA-graph batch) is skipped.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    valid, blocks, offsets = slot_positions(slot_mapping, k_cache.shape[2])
    k_cache[blocks, :, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[valid].to(v_cache.dtype)


def slot_positions(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask of the tokens written, their block ids, their offsets in the block)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    return valid, slots // block_size, slots % block_size


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: one block per token; threads walk the token's num_kv_heads * head_dim
# elements (contiguous in the cache for one head) in 8-element chunks, so both the read and the
# write are coalesced 16-byte accesses when `vec` (head_dim a multiple of 8, aligned views: see
# vec_ok); otherwise element by element. key/value may be strided views (slices of the fused qkv
# projection).

from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import current_stream, launch  # noqa: E402
from voltserve.kernels.runtime.vec_io import VEC, ld8, st8, vec_ok  # noqa: E402

BLOCK = 128


@cuda.jit(device=True, inline="always")
def div_rem(i, n):
    """(i // n, i % n) for i >= 0, one division: the index math of every walk over the cache (a
    slot -> block and offset; a flat element -> head and dim, or page row and dim)."""
    q = i // n
    return q, i - q * n


@cuda.jit(device=True, inline="always")
def cache_row(t, slot, key, value, k_cache, v_cache, vec):
    """Writes row t of key/value to cache slot `slot` (skipped when negative); the block's
    threads share the elements. The kernel below, and the second half of
    rotary_cache.rotary_and_cache_kernel."""
    if slot < 0:
        return
    blk, off = div_rem(slot, k_cache.shape[2])
    heads, head_dim = key.shape[1], key.shape[2]
    if vec:
        e = cuda.threadIdx.x * VEC
        while e < heads * head_dim:
            h, d = div_rem(e, head_dim)
            kv = ld8(key, (t, h, d))
            vv = ld8(value, (t, h, d))
            st8(k_cache, (blk, h, off, d), kv)
            st8(v_cache, (blk, h, off, d), vv)
            e += cuda.blockDim.x * VEC
    else:
        e = cuda.threadIdx.x
        while e < heads * head_dim:
            h, d = div_rem(e, head_dim)
            k_cache[blk, h, off, d] = key[t, h, d]
            v_cache[blk, h, off, d] = value[t, h, d]
            e += cuda.blockDim.x


@cached
@cuda.jit
def reshape_and_cache_kernel(key, value, k_cache, v_cache, slot_mapping, vec):
    t = cuda.blockIdx.x
    cache_row(t, slot_mapping[t], key, value, k_cache, v_cache, vec)


def reshape_and_cache_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same meaning as reshape_and_cache_ref; slot_mapping is int64 (negative = skip)."""
    if key.shape[0]:
        vec = vec_ok(key, value, k_cache, v_cache)
        launch(
            reshape_and_cache_kernel,
            key.shape[0],
            BLOCK,
            (key, value, k_cache, v_cache, slot_mapping, vec),
            current_stream(),
        )
