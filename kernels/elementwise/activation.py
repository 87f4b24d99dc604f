"""SiLU-and-multiply, the gated MLP activation: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up, as the merged gate_up projection produces); returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel. Grid (T, column chunks); each thread handles PER_THREAD 8-element chunks
# (16-byte accesses for fp16) strided by the block size, so a warp's accesses stay contiguous.
# All of a thread's loads are issued before its first store (a store to out could alias x, so
# the compiler would not move later loads above it). Rounding follows the reference: silu(gate)
# is rounded to the storage dtype before the multiply. `vec` (vec_ok on the host) selects the
# vector path; otherwise the same chunks are read element by element.

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    current_stream,
    float32,
    launch,
    round_like,
)
from voltserve.kernels.runtime.vec_io import VEC, load_row8, store_row8, vec_ok  # noqa: E402

PER_THREAD = 2  # 8-element chunks per thread
BLOCK = 256


@cuda.jit(device=True, inline="always")
def _silu_mul(g, u, out):
    return round_like(g / (float32(1.0) + float32(math.exp(-g))), out) * u


@cuda.jit(device=True, inline="always")
def _silu_mul8(g, u, out):
    return (
        _silu_mul(g[0], u[0], out),
        _silu_mul(g[1], u[1], out),
        _silu_mul(g[2], u[2], out),
        _silu_mul(g[3], u[3], out),
        _silu_mul(g[4], u[4], out),
        _silu_mul(g[5], u[5], out),
        _silu_mul(g[6], u[6], out),
        _silu_mul(g[7], u[7], out),
    )


@cached
@cuda.jit
def silu_and_mul_kernel(x, out, vec):
    row = cuda.blockIdx.x
    inter = out.shape[1]
    bd = cuda.blockDim.x
    c0 = (cuda.blockIdx.y * bd * PER_THREAD + cuda.threadIdx.x) * VEC
    c1 = c0 + bd * VEC
    if c0 < inter:
        g0 = load_row8(x, row, c0, inter, vec)
        u0 = load_row8(x, row, inter + c0, 2 * inter, vec)
        if c1 < inter:
            g1 = load_row8(x, row, c1, inter, vec)
            u1 = load_row8(x, row, inter + c1, 2 * inter, vec)
            store_row8(out, row, c0, inter, vec, _silu_mul8(g0, u0, out))
            store_row8(out, row, c1, inter, vec, _silu_mul8(g1, u1, out))
        else:
            store_row8(out, row, c0, inter, vec, _silu_mul8(g0, u0, out))


def grid_for(rows: int, inter: int) -> tuple[int, int]:
    per_block = BLOCK * PER_THREAD * VEC
    return rows, (inter + per_block - 1) // per_block


def silu_and_mul_cuda(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same meaning as silu_and_mul_ref. x: [T, 2I] with unit stride along the last dim."""
    T, two_i = x.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T:
        # The up half starts at column inter of each row: aligned iff inter is a multiple of 8.
        vec = inter % VEC == 0 and vec_ok(x, out)
        launch(
            silu_and_mul_kernel,
            grid_for(T, inter),
            BLOCK,
            (x, out, vec),
            current_stream(),
        )
    return out
