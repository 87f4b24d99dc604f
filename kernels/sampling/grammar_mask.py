"""Structured-output token masks: set the logits of tokens a grammar forbids to -inf.

The mask of one row is xgrammar's bitmask: int32 words, bit b of word w (two's complement,
bit 31 is the sign bit) allows token 32 w + b. Only the rows of constrained requests carry a
mask: `rows[m]` names the logits row that mask row m applies to, so an unconstrained row is
never read or written. Token ids past the mask's 32 W bits are forbidden (they cannot be
produced by the grammar's vocabulary).

The kernel runs one thread per (mask row, token): it reads one word and writes one logit, so
it costs one pass over the masked rows' logits; it never syncs with the host, so it works on
logits a CUDA graph produced (outside the graph) and in a captured step alike.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 -> [M, vocab] bool (True: allowed); tokens past 32 W are forbidden."""
    M, W = bitmask.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 stays readable
    allowed = bits.view(M, W * 32).bool()
    if W * 32 >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(M, vocab - W * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """In place: logits[rows[m], i] = -inf where bit i of bitmask[m] is clear.
    logits [N, V] float; bitmask [M, W] int32; rows [M] int64 (distinct)."""
    M = bitmask.shape[0]
    if M == 0:
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


# ---- the numba.cuda kernel ----------------------------------------------------------------------

import math  # noqa: E402

from numba import cuda, uint32  # noqa: E402
from voltserve.kernels.runtime.numba_common import current_stream, launch  # noqa: E402

MASK_BLOCK = 256
_NEG_INF = -math.inf


@cuda.jit
def apply_token_bitmask_kernel(logits, bitmask, rows):
    m = cuda.blockIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    V = logits.shape[1]
    if i >= V:
        return
    w = i >> 5
    allowed = False
    if w < bitmask.shape[1]:
        word = uint32(bitmask[m, w])
        allowed = ((word >> uint32(i & 31)) & uint32(1)) != uint32(0)
    if not allowed:
        logits[rows[m], i] = _NEG_INF


def apply_token_bitmask_cuda(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Same meaning as apply_token_bitmask_ref; logits fp32 [N, V] (unit stride along V; the
    sampler's working copy), bitmask int32 [M, W] contiguous, rows int64 [M] on the device."""
    M, V = bitmask.shape[0], logits.shape[1]
    if M == 0:
        return
    grid = (M, (V + MASK_BLOCK - 1) // MASK_BLOCK)
    launch(
        apply_token_bitmask_kernel,
        grid,
        MASK_BLOCK,
        (logits, bitmask, rows),
        current_stream(),
    )
