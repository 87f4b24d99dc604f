"""Per-head q/k RMSNorm, rotary and the KV-cache write in one launch (Qwen3's attention input).

A model with q/k norm (Qwen3 dense and MoE) otherwise runs rms_norm on every q head, rms_norm on
every k head, then rotary_and_cache: three launches per layer, each latency bound at decode. This
op does all three: q is normalised (the per-head-dim weight, eps) and rotated in place; k is
normalised and rotated on the way to the paged cache (kv_cache.py's layout; slot -1 = padding
row, skipped), and v is copied there. k itself is left as it came: the unfused path normalises
it into a new tensor, and nothing reads the qkv buffer's k after the cache write.

Rounding is the unfused path's: the normalised value is rounded to the storage dtype, multiplied
by the weight and rounded again (rmsnorm.py, transformers' RMSNorm); rotary rounds cos/sin and
every product and sum to the storage dtype (rotary.py).
"""

from __future__ import annotations

import numpy as np
import torch
from voltserve.kernels.attention.kv_cache import reshape_and_cache_ref
from voltserve.kernels.attention.rotary import rotary_embedding_ref
from voltserve.kernels.elementwise.rmsnorm import rms_norm_ref


def qk_norm_rope_and_cache_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads * head_dim] (row views of the fused qkv output are fine)
    k: torch.Tensor,  # [T, num_kv_heads * head_dim]; read only
    v: torch.Tensor,  # [T, num_kv_heads * head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    head_dim: int,
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    is_neox: bool,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip
) -> None:
    """rms_norm_ref on every head of q (written back into q) and of k (into a new tensor),
    rotary_embedding_ref on both, then reshape_and_cache_ref of the rotated k and v."""
    T = q.shape[0]
    kn = _norm_heads(k, k_weight, eps, head_dim)
    q.copy_(_norm_heads(q, q_weight, eps, head_dim))
    rotary_embedding_ref(positions, q, kn, head_dim, cos_sin_cache, is_neox)
    kv_heads = k_cache.shape[1]
    reshape_and_cache_ref(
        kn.view(T, kv_heads, head_dim),
        v.view(T, kv_heads, head_dim),
        k_cache,
        v_cache,
        slot_mapping,
    )


def _norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """rms_norm_ref over each head of x [T, heads * head_dim], as a new [T, heads * head_dim]."""
    return rms_norm_ref(x.reshape(-1, head_dim), weight, eps).view(x.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: one warp per (token, head), WARPS warps per block, no block barrier. A lane
# holds head_dim / 32 elements of its head (at most MAXE), dims lane + 32 * n, so each load and
# store of the warp touches 32 consecutive elements. The sum of squares is a butterfly of warp
# shuffles (every lane ends with the same sum: each step adds the same two values). With
# rotary_dim / 2 a multiple of 32, NeoX's partner of dim j < rotary_dim / 2 (j + rotary_dim / 2)
# is in the same lane, so rotary needs no exchange: a lane keeps each pair in adjacent slots
# (_elem), so the pairing is by constant index and the slots stay in registers (a runtime index
# into a local array would put it in local memory). Warps past the last (token, head) work on
# head 0 of token 0 and store nothing: every lane reaches the shuffles (the simulator's shuffle
# is a block barrier).

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.attention.common import shfl_xor  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    current_stream,
    float32,
    launch,
    round_like,
)

OP = "qk_norm_rope_and_cache"
WARPS = 4  # warps per block
MAXE = 8  # elements per lane: head_dim up to 256


@cuda.jit(device=True, inline="always")
def _elem(lane, i, hn):
    """The head dim that slot i of a lane holds: slots 2m and 2m + 1 (m < hn) are the NeoX pair
    (lane + 32m, lane + 32m + rotary_dim / 2), the slots past 2hn the dims past rotary_dim."""
    if i < 2 * hn:
        return lane + 32 * ((i >> 1) + (i & 1) * hn)
    return lane + 32 * i


@cached
@cuda.jit
def qk_norm_rope_kernel(
    positions,
    q,
    k,
    v,
    q_weight,
    k_weight,
    eps,
    head_dim,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
):
    lane = cuda.threadIdx.x & 31
    warp = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
    q_heads = q.shape[1] // head_dim
    heads = q_heads + k.shape[1] // head_dim
    active = warp < q.shape[0] * heads
    if not active:
        warp = 0
    t = warp // heads
    h = warp - t * heads
    is_k = h >= q_heads
    kh = h - q_heads
    ne = head_dim >> 5  # elements per lane
    hn = cos_sin_cache.shape[1] >> 6  # rotary pairs per lane
    half = cos_sin_cache.shape[1] >> 1
    pos = positions[t]
    slot = slot_mapping[t]

    x = cuda.local.array(MAXE, float32)
    w = cuda.local.array(MAXE, float32)
    val = cuda.local.array(MAXE, float32)
    ss = float32(0.0)
    for i in range(MAXE):
        if i < ne:
            d = _elem(lane, i, hn)
            if is_k:
                x[i] = float32(k[t, kh * head_dim + d])
                w[i] = float32(k_weight[d])
                val[i] = float32(v[t, kh * head_dim + d])
            else:
                x[i] = float32(q[t, h * head_dim + d])
                w[i] = float32(q_weight[d])
            ss += x[i] * x[i]
    off = 16
    while off > 0:
        ss += shfl_xor(ss, off)
        off >>= 1
    inv = float32(float32(1.0) / float32(math.sqrt(float32(ss / float32(head_dim)) + eps)))
    for i in range(MAXE):
        # rms_norm's value: the normalised element rounded to storage, times the weight, rounded.
        if i < ne:
            x[i] = round_like(w[i] * round_like(x[i] * inv, q), q)
    for m in range(MAXE // 2):
        if m < hn:
            j = lane + 32 * m
            c = round_like(cos_sin_cache[pos, j], q)
            s = round_like(cos_sin_cache[pos, half + j], q)
            x1, x2 = x[2 * m], x[2 * m + 1]
            x[2 * m] = round_like(round_like(x1 * c, q) - round_like(x2 * s, q), q)
            x[2 * m + 1] = round_like(round_like(x2 * c, q) + round_like(x1 * s, q), q)
    if active:
        if is_k:
            if slot >= 0:
                block_size = k_cache.shape[2]
                blk = slot // block_size
                bo = slot - blk * block_size
                for i in range(MAXE):
                    if i < ne:
                        d = _elem(lane, i, hn)
                        k_cache[blk, kh, bo, d] = x[i]
                        v_cache[blk, kh, bo, d] = val[i]
        else:
            for i in range(MAXE):
                if i < ne:
                    q[t, h * head_dim + _elem(lane, i, hn)] = x[i]


def grid(tokens: int, heads: int, warps: int = WARPS) -> int:
    """Blocks for one warp per (token, head), `warps` warps a block."""
    return (tokens * heads + warps - 1) // warps


def fusable(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """What the kernel (and its registered signatures) is written for: NeoX rotary with
    rotary_dim a multiple of 64 (the pairs stay in a lane), head_dim a multiple of 32 up to 256,
    one fp16/fp32 storage dtype across q/k/v, the weights and the caches, an fp32 cos/sin cache,
    int64 positions and slots, contiguous caches and weights, 2-D q/k/v rows. Anything else
    takes the three separate ops."""
    rotary_dim = cos_sin_cache.shape[1]
    kv_heads = k_cache.shape[1]
    return (
        bool(is_neox)
        and head_dim % 32 == 0
        and 32 <= head_dim <= 32 * MAXE
        and rotary_dim % 64 == 0
        and rotary_dim <= head_dim
        and q.dtype in (torch.float16, torch.float32)
        and all(t.dtype == q.dtype for t in (k, v, q_weight, k_weight, k_cache, v_cache))
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and q_weight.is_contiguous()
        and k_weight.is_contiguous()
        and tuple(q_weight.shape) == (head_dim,) == tuple(k_weight.shape)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.dim() == k.dim() == v.dim() == 2
        and q.shape[1] % head_dim == 0
        and k.shape[1] == v.shape[1] == kv_heads * head_dim
        and k_cache.shape[3] == head_dim
    )


def covers(impl: dict[str, str], *args) -> bool:
    """Whether the model may call qk_norm_rope_and_cache for these inputs (its arguments, as
    passed to the op) instead of the three separate ops, given the dispatch's choices (`impl`,
    KernelDispatch.impl): the kernel for what `fusable` says; a reference or the graph fallback
    when the separate ops are of the same kind (CPU, VOLTSERVE_FORCE_REF, bf16), and not when
    VOLTSERVE_QK_NORM_ROPE=0 leaves it a reference beside the separate ops' kernels."""
    own = impl[OP]
    if own == "cuda":
        # The op's arguments carry eps after k_weight; what the kernel covers does not depend
        # on it. (One launch instead of three: BENCHMARKS.md §1 has the batch-1 figure.)
        positions, q, k, v, q_weight, k_weight, _eps, *rest = args
        return fusable(positions, q, k, v, q_weight, k_weight, *rest)
    return own == impl["rotary_and_cache"] and impl["rms_norm"] != "cuda"


def kernel_args(
    positions, q, k, v, q_weight, k_weight, eps: float, head_dim: int, cos_sin_cache, k_cache,
    v_cache, slot_mapping, as_array=None,
) -> tuple:  # fmt: skip
    """The kernel's arguments, in order (`as_array` maps each tensor; tests pass a simulator
    view; launches take the tensors themselves)."""
    arrays = (positions, q, k, v, q_weight, k_weight)
    tail = (cos_sin_cache, k_cache, v_cache, slot_mapping)
    if as_array is None:
        return (*arrays, np.float32(eps), int(head_dim), *tail)
    return (
        *(as_array(a) for a in arrays),
        np.float32(eps),
        int(head_dim),
        *(as_array(a) for a in tail),
    )


def qk_norm_rope_and_cache_cuda(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same meaning as qk_norm_rope_and_cache_ref, in one launch and without a host sync (for
    what `fusable` accepts; otherwise the separate launchers, with a copy of the normalised q
    back into q)."""
    T = q.shape[0]
    if not T:
        return
    args = (positions, q, k, v, q_weight, k_weight, head_dim, cos_sin_cache, is_neox)
    if not fusable(*args, k_cache, v_cache, slot_mapping):
        from voltserve.kernels.attention.rotary_cache import rotary_and_cache_cuda
        from voltserve.kernels.elementwise.rmsnorm import rms_norm_cuda

        q.copy_(rms_norm_cuda(q.reshape(-1, head_dim), q_weight, eps).view(T, -1))
        kn = rms_norm_cuda(k.reshape(-1, head_dim), k_weight, eps).view(T, -1)
        rotary_and_cache_cuda(
            positions, q, kn, v, head_dim, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping
        )
        return
    heads = (q.shape[1] + k.shape[1]) // head_dim
    launch(
        qk_norm_rope_kernel,
        grid(T, heads),
        WARPS * 32,
        kernel_args(
            positions, q, k, v, q_weight, k_weight, eps, head_dim, cos_sin_cache, k_cache,
            v_cache, slot_mapping,
        ),
        current_stream(),
    )  # fmt: skip
