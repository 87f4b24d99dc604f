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
    # The router never yields an id outside 0..E-1; the clamp is for the start-up trace
    # (services/executor/kernel_warmup.py), which records the kernels without running them, so
    # the ids are then uninitialised memory and an unclamped scatter could fault.
    flat = topk_ids.reshape(-1).long().clamp_(0, num_experts - 1)
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


# ---------------------------------------------------------------------------------------------
# numba.cuda: the router's softmax, top-k and normalisation in one launch (one warp per token).
# The router's linear runs before it (ops.gemv at decode). Exact ties go to the lowest expert
# index: torch.topk has no fixed order for ties (CPU and CUDA differ), so this is the one place
# the kernel and the reference may choose differently, and only between equal probabilities.
# VOLTSERVE_MOE_TOPK=0 keeps torch.topk (the reference) on CUDA too.

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.compile_cache import cached  # noqa: E402
from voltserve.kernels.numba_common import (  # noqa: E402
    NEG_INF,
    block_argmax,
    block_max,
    block_sum,
    current_stream,
    dev,
    float32,
    int32,
    launch,
    round_like,
)

# One warp per token: at decode the kernel is latency-bound (k passes of a block argmax), and a
# one-warp block's barriers are nearly free; 1024 experts are 32 per lane per pass.
TOPK_THREADS = 32
MAX_EXPERTS = 1024
MAX_TOP_K = 32


@cached
@cuda.jit
def moe_topk_kernel(logits, weights, ids, renormalize, round_weights):
    # logits [T, E], weights [T, k] fp32, ids [T, k] int32
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bd = cuda.blockDim.x
    E = logits.shape[1]
    k = ids.shape[1]
    p = cuda.shared.array(MAX_EXPERTS, float32)
    sel_v = cuda.shared.array(MAX_TOP_K, float32)
    sel_i = cuda.shared.array(MAX_TOP_K, int32)
    sf = cuda.shared.array(32, float32)
    si = cuda.shared.array(32, int32)
    m = NEG_INF
    e = tid
    while e < E:
        v = float32(logits[t, e])
        p[e] = v
        if v > m:
            m = v
        e += bd
    m = block_max(m, sf)
    z = float32(0.0)
    e = tid
    while e < E:
        ex = float32(math.exp(p[e] - m))
        p[e] = ex
        z += ex
        e += bd
    z = block_sum(z, sf)
    e = tid
    while e < E:
        p[e] = p[e] / z
        e += bd
    cuda.syncthreads()
    total = float32(0.0)
    for j in range(k):
        bv = NEG_INF
        bi = E
        e = tid
        while e < E:  # ascending e and a strict > keep the lowest index of a tie
            if p[e] > bv:
                bv = p[e]
                bi = e
            e += bd
        bv, bi = block_argmax(bv, bi, sf, si)
        total += bv
        if tid == 0:
            sel_v[j] = bv
            sel_i[j] = bi
            p[bi] = float32(-1.0)  # taken (probabilities are >= 0)
        cuda.syncthreads()
    if tid < k:
        w = sel_v[tid]
        if renormalize:
            w = w / total
        if round_weights:
            w = round_like(w, logits)
        weights[t, tid] = w
        ids[t, tid] = sel_i[tid]


moe_topk_cuda_dtypes = (torch.float16, torch.float32)


def moe_topk_cuda(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same meaning as moe_topk_ref (one launch, no host sync); other inputs go to the
    reference."""
    x = router_logits
    round_weights = weights_dtype is not None and weights_dtype != torch.float32
    ok = (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in moe_topk_cuda_dtypes
        and x.is_contiguous()
        and 1 <= top_k <= min(x.shape[1], MAX_TOP_K)
        and x.shape[1] <= MAX_EXPERTS
        and (not round_weights or weights_dtype == x.dtype)
    )
    if not ok or x.shape[0] == 0:
        return moe_topk_ref(x, top_k, renormalize, weights_dtype)
    T = x.shape[0]
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    launch(
        moe_topk_kernel,
        T,
        TOPK_THREADS,
        (dev(x), dev(weights), dev(ids), bool(renormalize), round_weights),
        current_stream(),
    )
    return weights, ids


__all__ = ["moe_topk_ref", "moe_topk_cuda", "moe_align_ref", "max_tiles", "moe_topk_kernel"]
