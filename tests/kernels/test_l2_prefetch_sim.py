"""The L2 prefetch kernel reads every 16-byte chunk it is given exactly once: with the flag set,
its sink holds the XOR of all the words (one thread, so one sink value covers the whole tensor)."""

from __future__ import annotations

import numpy as np
import pytest
from voltserve.kernels.l2_prefetch import CHUNK, l2_prefetch_kernel
from voltserve.kernels.numba_common import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


@pytest.mark.parametrize("n_chunks", [1, 3, 4, 9, 37])
def test_reads_every_chunk(n_chunks):
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, size=n_chunks * 4 + 4, dtype=np.uint64).astype(np.uint32)
    flat = words.view(np.float16)  # the tail chunk past n_chunks must not be read
    sink = np.zeros(1, np.uint32)
    l2_prefetch_kernel[1, 1](flat, n_chunks, sink, 1)
    want = np.bitwise_xor.reduce(words[: n_chunks * 4])
    assert sink[0] == want
    assert flat.size == (n_chunks + 1) * CHUNK
