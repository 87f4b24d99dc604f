"""The structured-output mask kernel against its torch reference in the CUDA simulator, and the
reference against a per-token loop over xgrammar's bit layout."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch
from voltserve.kernels.runtime.numba_common import SIM, launch
from voltserve.kernels.sampling import grammar_mask

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return random.Random(seed)


def random_case(rng: random.Random, N: int, V: int, W: int, M: int):
    logits = torch.tensor([[rng.gauss(0, 3) for _ in range(V)] for _ in range(N)])
    bitmask = torch.tensor(
        [[rng.randrange(-(1 << 31), 1 << 31) for _ in range(W)] for _ in range(M)],
        dtype=torch.int32,
    )
    rows = torch.tensor(rng.sample(range(N), M), dtype=torch.int64)
    return logits, bitmask, rows


def loop_reference(logits, bitmask, rows):
    out = logits.clone()
    W = bitmask.shape[1]
    for m, r in enumerate(rows.tolist()):
        for i in range(logits.shape[1]):
            word = int(bitmask[m, i // 32]) & 0xFFFFFFFF if i // 32 < W else 0
            if not (word >> (i % 32)) & 1:
                out[r, i] = -math.inf
    return out


@pytest.mark.parametrize("V,W", [(70, 3), (64, 2), (96, 2)])  # exact, padded, mask too narrow
def test_kernel_equals_reference(rng, V, W):
    N, M = 5, 3
    logits, bitmask, rows = random_case(rng, N, V, W, M)
    want = loop_reference(logits, bitmask, rows)
    ref = logits.clone()
    grammar_mask.apply_token_bitmask_ref(ref, bitmask, rows)
    assert torch.equal(ref, want)
    # The kernel writes in place: a poisoned row that it must leave alone and rows it must set.
    sim = logits.clone()
    untouched = [i for i in range(N) if i not in rows.tolist()]
    sim[untouched[0]] = float("nan")
    want[untouched[0]] = float("nan")
    args = (sim.numpy(), bitmask.numpy(), rows.numpy())
    grid = (M, (V + 31) // 32)
    launch(grammar_mask.apply_token_bitmask_kernel, grid, 32, args)
    assert torch.equal(torch.isnan(sim), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(sim[ok], want[ok])


def test_all_bits_set_and_clear(rng):
    V = 40
    logits = torch.randn(2, V)
    bitmask = torch.tensor([[-1, -1], [0, 0]], dtype=torch.int32)
    rows = torch.tensor([1, 0])
    out = logits.clone()
    launch(
        grammar_mask.apply_token_bitmask_kernel,
        (2, 2),
        32,
        (out.numpy(), bitmask.numpy(), rows.numpy()),
    )
    assert torch.equal(out[1], logits[1])
    assert torch.isinf(out[0]).all() and (out[0] < 0).all()


def test_reference_matches_xgrammar_layout():
    """Bit b of word w is token 32 w + b, as xgrammar writes it (its own apply on CPU)."""
    xgr = pytest.importorskip("xgrammar")
    V = 100
    bitmask = xgr.allocate_token_bitmask(2, V)
    bitmask[:] = 0
    allowed = [[0, 31, 32, 63, 99], [5, 64, 95]]
    for m, toks in enumerate(allowed):
        for t in toks:
            w = int(bitmask[m, t // 32]) & 0xFFFFFFFF
            w |= 1 << (t % 32)
            bitmask[m, t // 32] = w - (1 << 32) if w >= 1 << 31 else w
    logits = torch.randn(2, V)
    ours = logits.clone()
    grammar_mask.apply_token_bitmask_ref(ours, bitmask, torch.tensor([0, 1]))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, backend="torch_native")
    assert torch.equal(ours, theirs)
    for m, toks in enumerate(allowed):
        assert torch.isfinite(ours[m]).nonzero().flatten().tolist() == toks
    np.testing.assert_array_equal(
        grammar_mask.unpack_bitmask(bitmask, V).nonzero()[:, 1].numpy(), sum(allowed, [])
    )
