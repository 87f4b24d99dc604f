"""RMSNorm and RMSNorm fused with the residual add.

Rounding follows transformers' LlamaRMSNorm so fp16 outputs match it: the variance is taken in
fp32, the normalised value is cast back to the storage dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; returns a new [T, H] tensor in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual <- x + residual (in storage dtype); x <- rms_norm(residual) * weight."""
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels: one block per row, each thread owning 8-element chunks (16-byte accesses for
# fp16) at chunk index tid, tid + blockDim, ... Its first MAXV chunks stay in registers, so the
# normalise pass re-reads memory only for rows wider than MAXV * 8 * blockDim (8192 at 256
# threads; the tail of wider rows is read again, mostly from L2). The loads of all of a thread's
# chunks are issued before any use, so MAXV * 16 bytes per thread are in flight. `vec` (from
# vec_ok on the host) selects the vector path; otherwise the same chunks are read element by
# element (widths not a multiple of 8, unaligned views).

import math  # noqa: E402

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    block_sum,
    current_stream,
    float32,
    launch,
    round_like,
)
from voltserve.kernels.runtime.vec_io import (  # noqa: E402
    VEC,
    ZERO8,
    dot8,
    ld8,
    load_row8,
    load_vec8,
    st8,
    store_row8,
    tup8,
    vec_ok,
)

MAXV = 4  # 8-element chunks a thread keeps in registers
BUF = MAXV * VEC  # their elements (a local array size must be a constant)
SMALL_BATCH = 256  # up to this many rows, one chunk per thread (more threads, shorter latency)
MAX_BLOCK = 256


@cuda.jit(device=True, inline="always")
def _inv_rms(ss, scratch, hidden, eps):
    total = block_sum(ss, scratch)
    return float32(float32(1.0) / float32(math.sqrt(float32(total / float32(hidden)) + eps)))


@cuda.jit(device=True, inline="always")
def _sq8(v):
    return dot8(float32(0.0), v, v)


@cuda.jit(device=True, inline="always")
def _add8(r, v, like):
    """r + v rounded to like's dtype, as the residual add stores it."""
    return (
        round_like(r[0] + v[0], like),
        round_like(r[1] + v[1], like),
        round_like(r[2] + v[2], like),
        round_like(r[3] + v[3], like),
        round_like(r[4] + v[4], like),
        round_like(r[5] + v[5], like),
        round_like(r[6] + v[6], like),
        round_like(r[7] + v[7], like),
    )


@cuda.jit(device=True, inline="always")
def _nw(v, w, inv, like):
    return float32(w) * round_like(v * inv, like)


@cuda.jit(device=True, inline="always")
def _scale8(v, w, inv, like):
    """The normalised chunk times the weight (rounded as rms_norm_ref rounds; st8 rounds last)."""
    return (
        _nw(v[0], w[0], inv, like),
        _nw(v[1], w[1], inv, like),
        _nw(v[2], w[2], inv, like),
        _nw(v[3], w[3], inv, like),
        _nw(v[4], w[4], inv, like),
        _nw(v[5], w[5], inv, like),
        _nw(v[6], w[6], inv, like),
        _nw(v[7], w[7], inv, like),
    )


@cached
@cuda.jit
def rms_norm_kernel(x, weight, out, eps, vec):
    row = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    buf = cuda.local.array(BUF, float32)
    for j in range(MAXV):
        c = (tid + j * bd) * VEC
        if c < hidden:
            v = load_row8(x, row, c, hidden, vec)
            for e in range(VEC):
                buf[j * VEC + e] = v[e]
    ss = float32(0.0)
    for j in range(MAXV):
        if (tid + j * bd) * VEC < hidden:
            for e in range(VEC):
                ss += buf[j * VEC + e] * buf[j * VEC + e]
    c = (tid + MAXV * bd) * VEC
    while c < hidden:  # the tail of very wide rows: read again below
        v = load_row8(x, row, c, hidden, vec)
        for e in range(VEC):
            ss += v[e] * v[e]
        c += bd * VEC
    inv = _inv_rms(ss, scratch, hidden, eps)
    for j in range(MAXV):
        c = (tid + j * bd) * VEC
        if c < hidden:
            w = load_vec8(weight, c, hidden, vec)
            for e in range(VEC):
                buf[j * VEC + e] = float32(w[e]) * round_like(buf[j * VEC + e] * inv, out)
            store_row8(out, row, c, hidden, vec, tup8(buf, j * VEC))
    c = (tid + MAXV * bd) * VEC
    while c < hidden:
        v = load_row8(x, row, c, hidden, vec)
        w = load_vec8(weight, c, hidden, vec)
        for e in range(VEC):
            buf[e] = float32(w[e]) * round_like(v[e] * inv, out)
        store_row8(out, row, c, hidden, vec, tup8(buf, 0))
        c += bd * VEC


@cached
@cuda.jit
def fused_add_rms_norm_kernel(x, residual, weight, eps, vec):
    row = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    buf = cuda.local.array(BUF, float32)
    xb = cuda.local.array(BUF, float32)
    # Every load first (a store to residual would otherwise keep the next loads waiting: the
    # compiler cannot prove x and residual apart), then the add and the residual stores.
    for j in range(MAXV):
        c = (tid + j * bd) * VEC
        if c < hidden:
            r = load_row8(residual, row, c, hidden, vec)
            v = load_row8(x, row, c, hidden, vec)
            for e in range(VEC):
                buf[j * VEC + e] = r[e]
                xb[j * VEC + e] = v[e]
    ss = float32(0.0)
    for j in range(MAXV):
        c = (tid + j * bd) * VEC
        if c < hidden:
            for e in range(VEC):
                s = round_like(buf[j * VEC + e] + xb[j * VEC + e], residual)
                buf[j * VEC + e] = s
                ss += s * s
            store_row8(residual, row, c, hidden, vec, tup8(buf, j * VEC))
    c = (tid + MAXV * bd) * VEC
    while c < hidden:  # the tail of very wide rows: its residual is read back below
        r = load_row8(residual, row, c, hidden, vec)
        v = load_row8(x, row, c, hidden, vec)
        for e in range(VEC):
            s = round_like(r[e] + v[e], residual)
            xb[e] = s
            ss += s * s
        store_row8(residual, row, c, hidden, vec, tup8(xb, 0))
        c += bd * VEC
    inv = _inv_rms(ss, scratch, hidden, eps)
    for j in range(MAXV):
        c = (tid + j * bd) * VEC
        if c < hidden:
            w = load_vec8(weight, c, hidden, vec)
            for e in range(VEC):
                buf[j * VEC + e] = float32(w[e]) * round_like(buf[j * VEC + e] * inv, x)
            store_row8(x, row, c, hidden, vec, tup8(buf, j * VEC))
    c = (tid + MAXV * bd) * VEC
    while c < hidden:
        # This thread wrote residual[row, c:c+8] above, so reading it back is ordered.
        r = load_row8(residual, row, c, hidden, vec)
        w = load_vec8(weight, c, hidden, vec)
        for e in range(VEC):
            xb[e] = float32(w[e]) * round_like(r[e] * inv, x)
        store_row8(x, row, c, hidden, vec, tup8(xb, 0))
        c += bd * VEC


# Decode batches on the 16-byte path: one 8-element chunk per thread and every load of a thread
# (x, residual and the weight chunk) issued before the block reduction, so a row costs one
# memory round trip plus the reduction. The general kernels above read the weight after 1/rms,
# a second round trip (the norm weights do not stay in L2 across a decode step: the layer
# weights stream through it), and keep up to MAXV chunks per thread.
ONE_CHUNK_MAX_THREADS = 1024  # rows up to 8192 wide


@cached
@cuda.jit
def rms_norm_1c_kernel(x, weight, out, eps):
    row = cuda.blockIdx.x
    c = cuda.threadIdx.x * VEC
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    ok = c < hidden
    v = ZERO8
    w = ZERO8
    if ok:
        v = ld8(x, (row, c))
        w = ld8(weight, (c,))
    ss = _sq8(v)
    inv = _inv_rms(ss, scratch, hidden, eps)
    if ok:
        st8(out, (row, c), _scale8(v, w, inv, out))


@cached
@cuda.jit
def fused_add_rms_norm_1c_kernel(x, residual, weight, eps):
    row = cuda.blockIdx.x
    c = cuda.threadIdx.x * VEC
    hidden = x.shape[1]
    scratch = cuda.shared.array(32, float32)
    ok = c < hidden
    s = ZERO8
    w = ZERO8
    if ok:
        r = ld8(residual, (row, c))
        v = ld8(x, (row, c))
        w = ld8(weight, (c,))
        s = _add8(r, v, residual)
        st8(residual, (row, c), s)
    ss = _sq8(s)
    inv = _inv_rms(ss, scratch, hidden, eps)
    if ok:
        st8(x, (row, c), _scale8(s, w, inv, x))


def one_chunk(rows: int, hidden: int, vec: bool) -> bool:
    """Whether the one-chunk-per-thread kernels take these rows (decode batches, 16-byte path)."""
    return vec and rows <= SMALL_BATCH and hidden <= ONE_CHUNK_MAX_THREADS * VEC


def block_size(rows: int, hidden: int) -> int:
    """Threads per row: one 8-element chunk per thread for small batches (decode: the row is
    done in about one memory round trip), MAXV chunks per thread for large ones (fewer, fuller
    threads; more rows in flight per SM)."""
    chunks = (hidden + VEC - 1) // VEC
    per = 1 if rows <= SMALL_BATCH else MAXV
    want = (chunks + per - 1) // per
    # At most 256 threads: a block then fits an SM's 64K registers whatever the compiler gives
    # a thread (up to 255; these kernels take 72-128 on sm_70), so the launch never fails.
    return max(32, min(MAX_BLOCK, (want + 31) // 32 * 32))


def one_chunk_block(hidden: int) -> int:
    return max(32, ((hidden + VEC - 1) // VEC + 31) // 32 * 32)


def rms_norm_cuda(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same meaning as rms_norm_ref. x: [T, H] with unit stride along H. eps goes in as float32,
    the type kernels/registry.py lists (so the cc 7.0 check compiles what runs, and the kernel
    adds it in fp32 as the reference does)."""
    if out is None:
        out = torch.empty_like(x)
    vec = vec_ok(x, weight, out)
    if x.shape[0] and one_chunk(x.shape[0], x.shape[1], vec):
        launch(
            rms_norm_1c_kernel,
            x.shape[0],
            one_chunk_block(x.shape[1]),
            (x, weight, out, np.float32(eps)),
            current_stream(),
        )
    elif x.shape[0]:
        launch(
            rms_norm_kernel,
            x.shape[0],
            block_size(x.shape[0], x.shape[1]),
            (x, weight, out, np.float32(eps), vec),
            current_stream(),
        )
    return out


def fused_add_rms_norm_cuda(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Same meaning as fused_add_rms_norm_ref (in place on x and residual)."""
    vec = vec_ok(x, residual, weight)
    if x.shape[0] and one_chunk(x.shape[0], x.shape[1], vec):
        launch(
            fused_add_rms_norm_1c_kernel,
            x.shape[0],
            one_chunk_block(x.shape[1]),
            (x, residual, weight, np.float32(eps)),
            current_stream(),
        )
    elif x.shape[0]:
        launch(
            fused_add_rms_norm_kernel,
            x.shape[0],
            block_size(x.shape[0], x.shape[1]),
            (x, residual, weight, np.float32(eps), vec),
            current_stream(),
        )
