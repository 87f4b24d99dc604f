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
# numba.cuda: the router's softmax, top-k and normalisation in one launch, one warp per token,
# TOPK_WARPS tokens per block, no block barrier and no shared memory. The router's linear runs
# before it (ops.gemv at decode).
#
# Lane l holds the contiguous experts l * S .. l * S + S - 1 (S = ceil(E / 32) <= SLOTS) in
# registers: the slots are a local array indexed only by loop counters of constant trip count,
# which NVVM unrolls, so it never reaches local memory (a runtime index would put it there).
# Slots past E (and past S) hold -inf. Softmax: a butterfly max and a butterfly sum (every lane
# ends with the same fp32 sum: each step adds the same two values), then p = exp(x - max) / sum.
# Each of the k rounds: every lane's best slot (the lowest of its equal slots), the warp's max of
# those (5 shuffles), and the lowest lane holding it (one ballot).
# Since lanes own ascending runs of experts, the lowest such lane holds the lowest expert index
# of all equal probabilities: exact ties go to the lowest index. torch.topk leaves the order of
# ties open (CPU and CUDA differ), so that is the one place the kernel and the reference may
# choose differently, and only between equal probabilities. The winning lane writes the id and
# marks its slot taken (-1: probabilities are >= 0); lane r keeps round r's probability and, after
# the k rounds, writes its weight (divided by the k probabilities' sum, added in rank order, when
# renormalising).
#
# VOLTSERVE_MOE_TOPK=0 keeps torch.topk (the reference) on CUDA too.

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.launch_geometry import on_gpu  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    FULL_MASK,
    NEG_INF,
    SIM,
    current_stream,
    float32,
    int32,
    launch,
    round_like,
)

# Tokens (warps) per block. A token's work is one warp's latency chain, so decode batches gain
# nothing from one-warp blocks; four-warp blocks let a prefill of thousands of rows fit in one
# wave (a multiprocessor holds at most 32 blocks but 64 warps), and a decode step of T <= 4 is
# still one block.
TOPK_WARPS = 4
TOPK_THREADS = 32 * TOPK_WARPS
# Experts per lane: E <= 256 (wider routers go to the reference, torch ops, also capturable).
# The kernel's per-round scan is written out for exactly 8 slots.
SLOTS = 8
MAX_EXPERTS = 32 * SLOTS
MAX_TOP_K = 32  # lane r keeps round r's probability


def topk_grid(num_tokens: int) -> int:
    """Blocks of the top-k launch for num_tokens rows (fixed by T: graph-capturable)."""
    return (num_tokens + TOPK_WARPS - 1) // TOPK_WARPS


if SIM:
    # The simulator has no warp primitives. Each helper is one exchange through the block's
    # shared state between two barriers (every live lane of the block calls it the same number of
    # times: the count depends on k alone, and a warp past the last token returns before the
    # first), and then computes what the GPU body computes: the same butterfly order for the sum.
    import threading

    import numpy as np

    def _warp_values(v):
        th = threading.current_thread()
        slots = th._manager.__dict__.setdefault("_voltserve_topk", {})
        tid = th.thread_id
        slots[tid] = v
        th.syncthreads()
        base = tid & ~31
        vals = [slots[base + lane] for lane in range(32)]
        th.syncthreads()
        return vals, tid & 31

    def _warp_max(v):
        return float32(max(_warp_values(v)[0]))  # never NaN: -inf or probabilities

    def _warp_sum(v):
        vals, lane = _warp_values(v)
        a = np.array(vals, dtype=np.float32)
        for off in (16, 8, 4, 2, 1):
            a = a + a[np.arange(32) ^ off]
        return a[lane]

    def _warp_best(v):
        vals, _ = _warp_values(v)
        best = max(vals)
        return float32(best), vals.index(best)  # the lowest lane holding the max

else:
    from voltserve.kernels.attention.common import shfl_xor

    @cuda.jit(device=True, inline="always")
    def _warp_max(v):
        """The warp's max of v (never NaN here: v is -inf or a probability)."""
        off = 16
        while off > 0:
            o = shfl_xor(v, off)
            if o > v:
                v = o
            off >>= 1
        return v

    @cuda.jit(device=True, inline="always")
    def _warp_sum(v):
        off = 16
        while off > 0:
            v += shfl_xor(v, off)
            off >>= 1
        return v

    @cuda.jit(device=True, inline="always")
    def _warp_best(v):
        """(the warp's max of v, the lowest lane holding it): a butterfly, then one ballot."""
        best = _warp_max(v)
        return best, cuda.ffs(cuda.ballot_sync(FULL_MASK, v == best)) - 1


def _pick(a, ma, b, mb):
    """(value, one-hot slot mask) of the larger of two slots; b only when strictly larger, so
    of equal values the lower slot (the left operand) stays."""
    if b > a:
        return b, mb
    return a, ma


if not SIM:  # the simulator calls it as plain Python (its device-function calls are slow)
    _pick = cuda.jit(device=True, inline="always")(_pick)


@cached
@cuda.jit
def moe_topk_kernel(logits, weights, ids, renormalize, round_weights):
    # logits [T, E], weights [T, k] fp32, ids [T, k] int32
    lane = cuda.threadIdx.x & 31
    t = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
    if t >= logits.shape[0]:
        return  # a whole warp: no lane of a live warp misses a shuffle
    E = logits.shape[1]
    k = ids.shape[1]
    S = (E + 31) >> 5
    base = lane * S
    p = cuda.local.array(SLOTS, float32)
    for j in range(SLOTS):
        # Every lane loads all SLOTS (clamped into the row, the same few cache lines) and masks
        # afterwards: a load under a branch is followed by its conversion in the same block, so
        # the loads would wait for each other, one memory latency per slot.
        e = base + j
        if e > E - 1:
            e = E - 1
        v = float32(logits[t, e])
        p[j] = v if j < S and base + j < E else NEG_INF
    m = NEG_INF
    for j in range(SLOTS):
        if p[j] > m:
            m = p[j]
    m = _warp_max(m)
    z = float32(0.0)
    for j in range(SLOTS):
        if j < S and base + j < E:
            ex = float32(math.exp(p[j] - m))
            p[j] = ex
            z += ex
    z = _warp_sum(z)
    for j in range(SLOTS):
        if j < S and base + j < E:
            q = p[j] / z
            # A NaN or +inf logit makes the whole row NaN (as torch's softmax). Selected as 0,
            # such a row still gets k distinct ids within 0..E-1 (the expert kernels index
            # weights by them); its inputs, and so its output, are NaN anyway.
            p[j] = q if q >= 0 else float32(0.0)
    total = float32(0.0)
    mine = float32(0.0)
    for r in range(k):
        # The lane's best slot: a tree over the 8 slots (depth 3, not a chain of 8), equal values
        # to the lower slot. The slot is carried as a one-hot mask, so marking it below is eight
        # independent selects (carried as an index j, LLVM folds those into one store at p[j],
        # a runtime index, and the slots go to local memory).
        v0, m0 = _pick(p[0], int32(1), p[1], int32(2))
        v1, m1 = _pick(p[2], int32(4), p[3], int32(8))
        v2, m2 = _pick(p[4], int32(16), p[5], int32(32))
        v3, m3 = _pick(p[6], int32(64), p[7], int32(128))
        v0, m0 = _pick(v0, m0, v1, m1)
        v2, m2 = _pick(v2, m2, v3, m3)
        bv, bm = _pick(v0, m0, v2, m2)
        best, winner = _warp_best(bv)
        # best >= 0 (k <= E leaves an untaken probability every round) and some lane holds it
        # exactly (a max returns one of its inputs), so exactly one lane wins, at a real slot.
        if lane == winner:
            ids[t, r] = base + cuda.ffs(bm) - 1
            for j in range(SLOTS):
                if bm & (int32(1) << int32(j)):
                    p[j] = float32(-1.0)  # taken (probabilities are >= 0)
        if lane == r:
            mine = best
        total += best
    if lane < k:
        w = mine
        if renormalize:
            w = w / total
        if round_weights:
            w = round_like(w, logits)
        weights[t, lane] = w


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
        on_gpu(x)
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
        topk_grid(T),
        TOPK_THREADS,
        (x, weights, ids, bool(renormalize), round_weights),
        current_stream(),
    )
    return weights, ids


__all__ = [
    "moe_topk_ref",
    "moe_topk_cuda",
    "moe_align_ref",
    "max_tiles",
    "moe_topk_kernel",
    "topk_grid",
]
