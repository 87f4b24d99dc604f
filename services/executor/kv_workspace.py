"""The workspace a one-byte KV cache's pages are widened into before attention reads them
(kv_quant.KVQuant.attend): K and V of one layer's cache shape in the run dtype, so the attention
kernels index it with the step's own block tables, unchanged.

One buffer serves every layer, the target's and a proposer's own model's: layers run one after
another, and each widens the pages it reads just before its attention. A cache of any shape
takes a view of the buffer's head, so the same buffer serves the draft's cache (its own heads)
and the small caches of the start-up forwards. Its bytes per block are counted by the KV sizing
(kv_sizing.workspace_bytes_per_block); it is reserved with each cache (kv_sizing.alloc_kv_caches)
and never grows once a CUDA graph may hold its address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class KVWorkspace:
    dtype: torch.dtype  # the run dtype: what the attention kernels read
    device: torch.device
    buf: torch.Tensor | None = None  # flat: K in [0, n), V in [n, 2n) of a cache of n elements

    def reserve(self, cache_numel: int) -> None:
        """Hold the K and V of a cache of cache_numel elements per tensor (kept if larger)."""
        need = 2 * cache_numel
        if self.buf is not None and self.buf.numel() >= need:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A graph captured on the old buffer would read freed memory.
            raise RuntimeError("the KV workspace cannot grow during CUDA graph capture")
        self.buf = None  # freed before the larger one is made
        self.buf = torch.zeros(need, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the buffer (after the start-up forwards on temporary caches)."""
        self.buf = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def views(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V workspaces of k_cache's shape (views: no copy, graph-stable addresses)."""
        n = k_cache.numel()
        if self.buf is None or self.buf.numel() < 2 * n:
            have = 0 if self.buf is None else self.buf.numel()
            raise RuntimeError(
                f"the KV workspace holds {have} elements, not the {2 * n} of a cache of shape "
                f"{tuple(k_cache.shape)} (it is reserved with each cache: alloc_kv_caches)"
            )
        return self.buf[:n].view(k_cache.shape), self.buf[n : 2 * n].view(k_cache.shape)

    def scrub(self) -> None:
        """Zero it (after non-finite activations: ModelRunner.scrub_kv_blocks says why)."""
        if self.buf is not None:
            self.buf.zero_()
