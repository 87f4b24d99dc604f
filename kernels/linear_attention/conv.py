"""The causal depthwise conv1d (with SiLU) in front of the gated delta rule: over a packed
prefill batch, and its one-token decode update. Channels are the conv_dim = 2 * Hk * Dk + Hv * Dv
columns of the fused q/k/v projection; weight [conv_dim, K]; a request's conv state (pool row
[conv_dim, K - 1], oldest first) holds its last K - 1 inputs, so output t of a sequence is
silu(sum_k weight[:, k] * x[t - (K - 1) + k]) with the inputs before the sequence's start taken
from the state (or zeros for a sequence with no initial state).

Rounding as transformers': the conv sum in fp32, rounded to the storage dtype, then SiLU.

Kernels (CUDA cores, elementwise and memory bound): prefill is two launches. The first has one
thread per (token, channel), 256 channels a block, grid (tokens, conv_dim / 256): each thread
finds its token's sequence (binary search of cu_seqlens) and reads its K inputs (from x or the
old state). The second, one thread per (sequence, channel), writes the final state; it runs
after the first on the stream, so no output reads a state that is already overwritten. Decode:
one thread per (request, channel) reads the state and the new input, writes the output and the
shifted state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from numba import cuda
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch, round_like

THREADS = 256
MAX_STATE = 8  # kernel - 1 inputs a thread holds (Qwen3-Next / 3.5: 3)


def _silu_conv(x_ext: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x_ext [D, K - 1 + n] fp32 -> [n, D]: depthwise conv, rounded to dtype, SiLU."""
    y = F.conv1d(x_ext[None], weight.float()[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y.to(dtype).float()).to(dtype).t()


def causal_conv1d_prefill_ref(
    x: torch.Tensor,  # [T, D] packed tokens of every sequence
    weight: torch.Tensor,  # [D, K]
    conv_pool: torch.Tensor,  # [num_slots, D, K - 1], updated in place
    cu_seqlens: torch.Tensor,  # [N + 1] int64
    slots: torch.Tensor,  # [N] int64, -1 = padding
    has_initial: torch.Tensor,  # [N] bool: start from the slot's state (else zeros)
) -> torch.Tensor:
    """Returns silu(conv(x)) [T, D] in x's dtype (zeros for padding sequences); writes each
    sequence's final conv state into conv_pool[slots[i]]."""
    out = torch.zeros_like(x)
    K1 = conv_pool.shape[-1]
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        start, end = cu[i], cu[i + 1]
        init = conv_pool[slot].float() if bool(has_initial[i]) else x.new_zeros(x.shape[1], K1)
        x_ext = torch.cat([init.float(), x[start:end].float().t()], dim=1)
        if end > start:
            out[start:end] = _silu_conv(x_ext, weight, x.dtype)
        conv_pool[slot] = x_ext[:, x_ext.shape[1] - K1 :].to(conv_pool.dtype)
    return out


def causal_conv1d_decode_ref(
    x: torch.Tensor,  # [B, D] one token a request
    weight: torch.Tensor,  # [D, K]
    conv_pool: torch.Tensor,  # [num_slots, D, K - 1], updated in place
    slots: torch.Tensor,  # [B] int64, -1 = padding
) -> torch.Tensor:
    out = torch.zeros_like(x)
    live = (slots >= 0).nonzero().flatten()
    if live.numel() == 0:
        return out
    idx = slots[live].long()
    x_ext = torch.cat([conv_pool[idx].float(), x[live].float()[:, :, None]], dim=2)  # [n, D, K]
    y = (x_ext * weight.float()[None]).sum(-1)
    out[live] = F.silu(y.to(x.dtype).float()).to(x.dtype)
    conv_pool[idx] = x_ext[:, :, 1:].to(conv_pool.dtype)
    return out


@cuda.jit(device=True, inline="always")
def silu_rounded(y, like):
    y = round_like(y, like)
    return y / (float32(1.0) + float32(math.exp(-y)))


@cached
@cuda.jit
def conv_prefill_kernel(x, weight, conv_pool, cu_seqlens, slots, has_initial, out):
    t = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    D, K = x.shape[1], weight.shape[1]
    if d >= D:
        return
    lo, hi = 0, cu_seqlens.shape[0] - 1  # the sequence: cu[lo] <= t < cu[lo + 1]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if cu_seqlens[mid] <= t:
            lo = mid
        else:
            hi = mid
    slot = slots[lo]
    if slot < 0:
        out[t, d] = 0.0
        return
    start = cu_seqlens[lo]
    init = has_initial[lo]
    acc = float32(0.0)
    for kk in range(K):
        src = t - (K - 1) + kk
        xv = float32(0.0)
        if src >= start:
            xv = float32(x[src, d])
        elif init:
            xv = float32(conv_pool[slot, d, src - start + K - 1])
        acc += float32(weight[d, kk]) * xv
    out[t, d] = silu_rounded(acc, out)


@cached
@cuda.jit
def conv_state_kernel(x, conv_pool, cu_seqlens, slots, has_initial):
    seq = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    D, K1 = x.shape[1], conv_pool.shape[2]
    slot = slots[seq]
    if d >= D or slot < 0:
        return
    start, end = cu_seqlens[seq], cu_seqlens[seq + 1]
    old = cuda.local.array(MAX_STATE, float32)
    for j in range(MAX_STATE):
        old[j] = 0.0
        if j < K1 and has_initial[seq]:
            old[j] = float32(conv_pool[slot, d, j])
    n = end - start
    for j in range(K1):
        src = n - K1 + j  # position in the sequence; negative: still the old state
        if src >= 0:
            conv_pool[slot, d, j] = x[start + src, d]
        else:
            conv_pool[slot, d, j] = old[src + K1]


@cached
@cuda.jit
def conv_decode_kernel(x, weight, conv_pool, slots, out):
    req = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    D, K1 = x.shape[1], conv_pool.shape[2]
    if d >= D:
        return
    slot = slots[req]
    if slot < 0:
        out[req, d] = 0.0
        return
    xv = x[req, d]
    acc = float32(weight[d, K1]) * float32(xv)
    prev = conv_pool[slot, d, 0]
    acc += float32(weight[d, 0]) * float32(prev)
    for j in range(1, K1):
        cur = conv_pool[slot, d, j]
        acc += float32(weight[d, j]) * float32(cur)
        conv_pool[slot, d, j - 1] = cur
    conv_pool[slot, d, K1 - 1] = xv
    out[req, d] = silu_rounded(acc, out)


def check_shapes(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor) -> None:
    if not on_gpu(x):
        raise ValueError("the conv1d launchers need CUDA tensors")
    D, K = weight.shape
    if x.shape[1] != D or tuple(conv_pool.shape[1:]) != (D, K - 1):
        raise ValueError(
            f"conv shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, pool "
            f"{tuple(conv_pool.shape)} (want x [T, D], weight [D, K], pool [slots, D, K - 1])"
        )
    if not 2 <= K <= MAX_STATE + 1:
        raise ValueError(f"conv kernel width {K} outside 2..{MAX_STATE + 1}")
    if x.dtype != conv_pool.dtype or weight.dtype != x.dtype:
        raise ValueError(
            f"conv dtypes differ: x {x.dtype}, weight {weight.dtype}, pool {conv_pool.dtype}"
        )


def prefill_launches(x, weight, conv_pool, cu_seqlens, slots, has_initial, out) -> list[tuple]:
    """(kernel, grid, block, args) of the prefill conv (tests run the same list in the
    simulator). The state kernel comes second: it overwrites states the first one reads."""
    T, D = x.shape
    tiles = (D + THREADS - 1) // THREADS
    launches = []
    if T:
        args = (x, weight, conv_pool, cu_seqlens, slots, has_initial, out)
        launches.append((conv_prefill_kernel, (T, tiles), THREADS, args))
    if slots.shape[0]:
        args = (x, conv_pool, cu_seqlens, slots, has_initial)
        launches.append((conv_state_kernel, (slots.shape[0], tiles), THREADS, args))
    return launches


def decode_launches(x, weight, conv_pool, slots, out) -> list[tuple]:
    B, D = x.shape
    if B == 0:
        return []
    args = (x, weight, conv_pool, slots, out)
    return [(conv_decode_kernel, (B, (D + THREADS - 1) // THREADS), THREADS, args)]


def causal_conv1d_prefill_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as causal_conv1d_prefill_ref; two launches, no host sync."""
    check_shapes(x, weight, conv_pool)
    out = torch.empty_like(x)
    stream = current_stream()
    for kernel, grid, block, args in prefill_launches(
        x, weight, conv_pool, cu_seqlens, slots, has_initial, out
    ):
        launch(kernel, grid, block, args, stream)
    return out


def causal_conv1d_decode_cuda(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Same meaning as causal_conv1d_decode_ref; one launch, no host sync (graph-safe)."""
    check_shapes(x, weight, conv_pool)
    out = torch.empty_like(x)
    stream = current_stream()
    for kernel, grid, block, args in decode_launches(x, weight, conv_pool, slots, out):
        launch(kernel, grid, block, args, stream)
    return out
