"""Read a tensor once so that it sits in L2 when the next kernel needs it.

Why: a batch-1 decode step alternates weight streams (the linears, bandwidth-bound) with small
kernels that are latency-bound and leave HBM idle (rotary + KV write, decode attention: ~15 us
per layer on an H200). A graph branch that streams the o_proj weight into L2 while those run
lets o_proj read it from L2 instead of HBM: the bytes are the same, but they move during time
the memory system would otherwise idle. Only worth it when the weight fits comfortably in L2
(an H200's 50 MB holds Llama-3-8B's 32 MB o_proj; a V100's 6 MB holds nothing useful), which the
caller checks with `fits_in_l2`.

The kernel issues plain 16-byte loads (an SM70 feature) and folds the words into a value it
stores only under a runtime flag the host always passes as 0, so the loads cannot be dropped.
Meaning (`l2_prefetch_ref`): nothing; it only warms a cache.
"""

from __future__ import annotations

import torch
from numba import cuda, uint32
from voltserve.kernels.attention_common import as_numba, ld_u32x4, torch_stream

THREADS = 256
UNROLL = 4  # 16-byte loads in flight per thread per iteration
CHUNK = 8  # fp16 elements per 16-byte load


def l2_prefetch_ref(t: torch.Tensor) -> None:
    """The reference does nothing: a prefetch has no visible effect."""
    return None


@cuda.jit
def l2_prefetch_kernel(flat, n_chunks, sink, flag):
    """flat: fp16 [n_chunks * 8 + tail]; reads chunks [0, n_chunks) 16 bytes at a time."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = uint32(0)
    while i + (UNROLL - 1) * stride < n_chunks:
        a0, a1, a2, a3 = ld_u32x4(flat, i * CHUNK)
        b0, b1, b2, b3 = ld_u32x4(flat, (i + stride) * CHUNK)
        c0, c1, c2, c3 = ld_u32x4(flat, (i + 2 * stride) * CHUNK)
        d0, d1, d2, d3 = ld_u32x4(flat, (i + 3 * stride) * CHUNK)
        acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3 ^ c0 ^ c1 ^ c2 ^ c3 ^ d0 ^ d1 ^ d2 ^ d3
        i += UNROLL * stride
    while i < n_chunks:
        a0, a1, a2, a3 = ld_u32x4(flat, i * CHUNK)
        acc ^= a0 ^ a1 ^ a2 ^ a3
        i += stride
    if flag != 0:
        sink[0] = acc


def fits_in_l2(t: torch.Tensor, fraction: float = 0.75) -> bool:
    """True when t takes at most `fraction` of the device's L2 (room left for what else runs)."""
    if not t.is_cuda:
        return False
    l2 = getattr(torch.cuda.get_device_properties(t.device), "L2_cache_size", 0)
    return 0 < t.numel() * t.element_size() <= fraction * l2


class L2Prefetcher:
    """Launches the prefetch of one tensor on torch's current stream (graph-capturable: no
    allocation, no sync). Holds the sink so capture never allocates."""

    def __init__(self, device: torch.device, num_sms: int | None = None) -> None:
        self.sink = torch.zeros(1, dtype=torch.int64, device=device)
        # The branch the prefetch runs on (forked from and joined to the main stream; inside a
        # capture that becomes a parallel branch of the graph).
        self.stream = torch.cuda.Stream(device)
        sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
        self.blocks = 4 * sms  # enough loads in flight to run at copy bandwidth

    def __call__(self, t: torch.Tensor) -> None:
        if t.dtype != torch.float16 or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("l2 prefetch takes a contiguous, 16-byte aligned fp16 tensor")
        flat = t.view(-1)
        l2_prefetch_kernel[self.blocks, THREADS, torch_stream()](
            as_numba(flat), flat.numel() // CHUNK, as_numba(self.sink), 0
        )
