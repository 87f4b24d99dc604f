"""Paged KV caches for the attention GPU tests: the pages of each sequence shuffled over the
cache, and the slots past each context filled with a value that would show if read."""

from __future__ import annotations

import torch

BLOCK = 16


def pages_for(seq_lens: list[int]) -> int:
    """Pages a cache for `seq_lens` holds: every sequence's blocks and 4 unused ones."""
    return sum((s + BLOCK - 1) // BLOCK for s in seq_lens) + 4


def shuffled_tables(
    seq_lens: list[int],
    k: torch.Tensor,  # [pages_for(seq_lens), kv_heads, BLOCK, head_dim]
    v: torch.Tensor,
    past_end: float | int,
    gen: torch.Generator,
    width: int | None = None,
) -> torch.Tensor:
    """Block tables [len(seq_lens), width] over a random permutation of the cache's pages; the
    slots of k and v past each sequence's length are set to `past_end` (in place)."""
    n_blocks = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    perm = torch.randperm(k.shape[0], generator=gen, device="cuda").int()
    width = width or max(max(n_blocks), 1)
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[pos : pos + n]
        pos += n
        tail = seq_lens[b] % BLOCK
        if tail:
            k[tables[b, n - 1], :, tail:] = past_end
            v[tables[b, n - 1], :, tail:] = past_end
    return tables
