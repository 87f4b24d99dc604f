"""SiLU-and-multiply, the gated MLP activation: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up, as the merged gate_up projection produces); returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel. Grid (T, column chunks); each thread handles PER_THREAD columns strided by
# the block size, so a warp's loads stay coalesced. Rounding follows the reference: silu(gate) is
# rounded to the storage dtype before the multiply.

import math  # noqa: E402

from numba import cuda  # noqa: E402
from voltserve.kernels.numba_common import (  # noqa: E402
    current_stream,
    dev,
    float32,
    launch,
    round_like,
)

PER_THREAD = 4
BLOCK = 256


@cuda.jit
def silu_and_mul_kernel(x, out):
    row = cuda.blockIdx.x
    inter = out.shape[1]
    bd = cuda.blockDim.x
    base = cuda.blockIdx.y * bd * PER_THREAD + cuda.threadIdx.x
    for j in range(PER_THREAD):
        c = base + j * bd
        if c < inter:
            g = float32(x[row, c])
            s = round_like(g / (float32(1.0) + float32(math.exp(-g))), out)
            out[row, c] = s * float32(x[row, inter + c])


def silu_and_mul_cuda(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same meaning as silu_and_mul_ref. x: [T, 2I] with unit stride along the last dim."""
    T, two_i = x.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T:
        grid = (T, (inter + BLOCK * PER_THREAD - 1) // (BLOCK * PER_THREAD))
        launch(silu_and_mul_kernel, grid, BLOCK, (dev(x), dev(out)), current_stream())
    return out
