"""The tensor-core prefill kernel's register-staged K/V fill (`fetch_kv` then `store_kv`,
kernels/prefill_attention_tc.py) in numba's CUDA simulator: a tile of N positions starting at
kv0, copied chunk by chunk from the paged caches into padded shared-memory-shaped rows, must
equal the sequence's K/V rows there, with zeros past the context (never the cache's stale
slots, which hold NaN here). The kernel that uses them links CUDA C++ and runs on a GPU only
(tests/gpu/test_prefill_tc_gpu.py); this checks the fill's indexing on the CPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the root conftest does this too; keep the file standalone
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from numba import cuda  # noqa: E402
from voltserve.kernels.prefill_attention_tc import BLOCK_SIZE, fetch_kv, store_kv  # noqa: E402

N = 32  # keys per tile (KV_TILE)


@cuda.jit
def fill_kernel(k_s, v_s, k_cache, v_cache, block_tables, b, kvh, nkv, seq_len, kv0, ch, ldk):
    """Every chunk of one tile, strided over the block's threads (as the kernel's fill)."""
    src = (k_cache, v_cache, block_tables, b, kvh, nkv, seq_len)
    for idx in range(cuda.threadIdx.x, N * ch, cuda.blockDim.x):
        r = fetch_kv(src, kv0, idx, ch, ch * 8)
        store_kv(k_s, v_s, r, idx, ch, ldk)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_len,kv0", [(70, 0), (70, 32), (70, 64), (5, 0), (48, 32)])
def test_fill_matches_the_cache_rows(seed, head_dim, seq_len, kv0):
    rng = np.random.default_rng(seed)
    kvh, num_kv_heads = 1, 2
    n_blocks = -(-seq_len // BLOCK_SIZE) + 3
    shape = (n_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    used = -(-seq_len // BLOCK_SIZE)
    perm = rng.permutation(n_blocks).astype(np.int32)
    tables = np.zeros((2, used + 1), dtype=np.int32)
    tables[1, :used] = perm[:used]
    for blk in perm[used:]:  # blocks no table entry points to: stale, NaN
        k[blk] = np.nan
        v[blk] = np.nan
    tail = seq_len % BLOCK_SIZE
    if tail:  # the last block's slots past the context: stale too
        k[perm[used - 1], :, tail:] = np.nan
        v[perm[used - 1], :, tail:] = np.nan
    ch = head_dim // 8
    ldk = head_dim + 8  # the kernel's padded row stride
    k_s = np.full(N * ldk, np.nan, dtype=np.float16)
    v_s = np.full(N * ldk, np.nan, dtype=np.float16)
    fill_kernel[1, 32](
        k_s, v_s, k.reshape(-1), v.reshape(-1), tables, 1, kvh, num_kv_heads, seq_len, kv0, ch, ldk
    )
    for t in range(N):
        pos = kv0 + t
        got_k = k_s[t * ldk : t * ldk + head_dim]
        got_v = v_s[t * ldk : t * ldk + head_dim]
        if pos < seq_len:
            blk = perm[pos // BLOCK_SIZE]
            np.testing.assert_array_equal(got_k, k[blk, kvh, pos % BLOCK_SIZE])
            np.testing.assert_array_equal(got_v, v[blk, kvh, pos % BLOCK_SIZE])
        else:
            assert (got_k == 0).all() and (got_v == 0).all(), f"position {pos} past {seq_len}"
        # the padding columns are never written
        assert np.isnan(k_s[t * ldk + head_dim : (t + 1) * ldk]).all()
