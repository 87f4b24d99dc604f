"""MoE routing on the device: the router's top-k, and the grouping of (token, expert) pairs by
expert that the grouped expert GEMMs read. Torch ops only, none of which synchronises with the
host (no .item(), nonzero() or boolean indexing; every shape follows from T, k and E alone), so
a CUDA graph can capture both.

Routing semantics (transformers' Qwen2-MoE, Qwen3-MoE and Mixtral routers): softmax of the
router logits in fp32, torch.topk (its order and its tie-breaking), then, where the family says
so (norm_topk_prob; always for Mixtral), division by the sum of the k kept probabilities. The
Qwen families then round the weights to the activation dtype (their router returns them in the
logits' dtype); Mixtral keeps them in fp32. `weights_dtype` says which.

Grouping (`moe_align_ref`): the P = T * k pairs, flattened row-major (pair p = token p // k,
slot p % k), are sorted by expert (stably, so within an expert pairs stay in token order). Expert
e owns sorted positions expert_start[e] .. expert_start[e + 1]; its rows are cut into tiles of
`block_m` rows. Tile t belongs to expert tile_expert[t] (E for tiles past the last one: a
kernel block handed such a tile does nothing) and is that expert's (t - tile_first[e])-th tile.
The number of tiles is bounded on the host by max_tiles(P, E, block_m), so the grid of a
grouped GEMM is fixed by T alone.
"""

from __future__ import annotations

import torch


def moe_topk_ref(
    router_logits: torch.Tensor,  # [T, E] in the activation dtype
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int32): softmax in fp32, torch.topk, optional
    renormalisation, and the weights rounded through `weights_dtype` when given."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None and weights_dtype != torch.float32:
        weights = weights.to(weights_dtype).float()
    return weights, ids.to(torch.int32)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m) over any split of num_pairs pairs:
    each expert with pairs adds at most one partial tile."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def moe_align_ref(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [P] int32: pair ids sorted by expert, expert_start [E + 1] int32,
    tile_first [E] int32, tile_expert [max_tiles] int32), as the module docstring says."""
    flat = topk_ids.reshape(-1).long()
    P, dev = flat.numel(), flat.device
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    expert_start = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    expert_start[1:] = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    tile_first = tile_end - tiles
    t = torch.arange(max_tiles(P, num_experts, block_m), device=dev)
    tile_expert = torch.searchsorted(tile_end, t, right=True)  # E past the last tile
    return (
        order.to(torch.int32),
        expert_start.to(torch.int32),
        tile_first.to(torch.int32),
        tile_expert.to(torch.int32),
    )


__all__ = ["moe_topk_ref", "moe_align_ref", "max_tiles"]
