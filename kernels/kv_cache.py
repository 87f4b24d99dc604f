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
    block_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[valid].to(v_cache.dtype)
