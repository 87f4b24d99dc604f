"""Sampling, argmax and penalty kernels against the torch references in the CUDA simulator.

Sampled ids must equal sample_ref's exactly, and both must keep what vLLM keeps: min-p, then
top-k over its survivors, then top-p over the renormalised mass of what is left (checked here
against a plain per-row implementation of that order). The only tolerated differences are the
documented boundary cases (kernels/sampling/sampling.py): a row where some token's kept mass before
it lies within float rounding of top_p times the kept mass, or a probability within rounding of
min_p times the largest, may keep one token more or fewer. Fresh random inputs make that
practically impossible here, and the test names the row if it happens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from voltserve.kernels.runtime.numba_common import SIM, launch
from voltserve.kernels.sampling import sampling

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
BLOCK = 32  # one simulated warp keeps the simulator fast; the kernel takes any multiple of 32


def np_args(*args):
    return tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)


def sample_sim(logits, temp, top_k, top_p, min_p, seeds, positions) -> torch.Tensor:
    out = torch.full((logits.shape[0],), -7, dtype=torch.int64)  # poisoned
    launch(
        sampling.sample_kernel,
        logits.shape[0],
        BLOCK,
        np_args(logits, temp, top_k, top_p, min_p, seeds, positions, out),
    )
    return out


def scaled_row(logits, temp, row: int) -> torch.Tensor:
    t = float(temp[row]) if float(temp[row]) > 1e-5 else 1.0
    return logits[row].double() / t


def vllm_keep_row(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The vLLM order, written out step by step on one row (float64): mask min-p's rejects to
    -inf, keep the top_k best of the rest (ties by id), renormalise what is left with a softmax
    and keep the most probable ones until their mass reaches top_p."""
    x = scaled.clone()
    probs = torch.softmax(x, -1)
    x[probs < min_p * probs.max()] = float("-inf")
    if top_k > 0:
        order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
        x[order[top_k:]] = float("-inf")
    if top_p < 1.0:
        probs = torch.softmax(x, -1)
        order = sorted(range(len(x)), key=lambda i: (-float(probs[i]), i))
        mass = 0.0
        for n, i in enumerate(order):
            if mass >= top_p:
                x[order[n:]] = float("-inf")
                break
            mass += float(probs[i])
    return set(torch.isfinite(x).nonzero().flatten().tolist())


def finite(scaled: torch.Tensor) -> set[int]:
    """Tokens that can be drawn at all (masked ones are -inf whatever the filters keep)."""
    return set(torch.isfinite(scaled).nonzero().flatten().tolist())


def old_keep_row(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The semantics this sampler had before: each filter on the full distribution, intersected."""
    probs = torch.softmax(scaled, -1)
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    keep = set(order[:top_k] if top_k > 0 else order)
    cum = 0.0
    # top_p = 1 is "off" (as in the sampler): a float sum of the probabilities can reach 1.0
    # before the last token, which would cut the tail.
    for n, i in enumerate(order if top_p < 1.0 else ()):
        if cum >= top_p:
            keep -= set(order[n:])
            break
        cum += float(probs[i])
    keep &= set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    return keep & finite(scaled)


def ambiguous(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float, tol=1e-5) -> bool:
    """A documented boundary case: the min-p threshold or the top-p cut within rounding."""
    probs = torch.softmax(scaled, -1)
    if min_p > 0 and ((probs - min_p * probs.max()).abs() < tol * probs.max()).any():
        return True
    if top_p >= 1.0:
        return False
    surv = sorted(vllm_keep_row(scaled, top_k, 1.0, min_p), key=lambda i: -float(probs[i]))
    q = probs[surv] / probs[surv].sum()
    cum_before = q.cumsum(0) - q
    return bool(((cum_before - top_p).abs() < tol).any())


def check_rows(args, got, ref):
    logits, temp, top_k, top_p, min_p = args[:5]
    for b in range(logits.shape[0]):
        if int(got[b]) != int(ref[b]):
            row = (scaled_row(logits, temp, b), int(top_k[b]), float(top_p[b]), float(min_p[b]))
            assert ambiguous(*row), (
                f"row {b}: kernel sampled {int(got[b])}, reference {int(ref[b])}"
            )


def random_filters(n: int, V: int):
    """Fresh per-row filter settings: each filter off or on at random, so rows combine them."""
    top_k = torch.where(torch.rand(n) < 0.6, torch.randint(1, V // 2, (n,)), 0).to(torch.int32)
    top_p = torch.where(torch.rand(n) < 0.7, torch.rand(n) * 0.7 + 0.25, 1.0)
    min_p = torch.where(torch.rand(n) < 0.5, torch.rand(n) * 0.3, 0.0)
    return top_k, top_p, min_p


def test_reference_keep_set_follows_vllm_order():
    B, V = 96, 200
    logits = torch.randn(B, V) * (torch.rand(B, 1) * 3 + 0.3)
    logits[torch.rand(B, V) < 0.05] = float("-inf")
    temp = torch.rand(B) * 1.5 + 0.3
    top_k, top_p, min_p = random_filters(B, V)
    # Rows that combine filters where the old intersection keeps more than the vLLM order. Their
    # logits are flat (0.4 of the mass spans far more than 25 tokens), so the two orders keep
    # different sets whatever the draw; a peaked row (one token over 0.4) would not tell them
    # apart.
    top_k[:8], top_p[:8], min_p[:8] = 25, 0.4, 0.0
    top_k[8:16], top_p[8:16], min_p[8:16] = 0, 0.5, 0.2
    logits[:16] = torch.randn(16, V) * 0.5
    temp[:16] = 1.0
    scaled = logits / temp[:, None]
    keep = sampling.sample_keep_ref(scaled, top_k, top_p, min_p)
    differs = 0
    for b in range(B):
        row = (scaled[b].double(), int(top_k[b]), float(top_p[b]), float(min_p[b]))
        want = vllm_keep_row(*row)
        got = set(keep[b].nonzero().flatten().tolist()) & finite(scaled[b])
        assert got == want or ambiguous(*row), (b, sorted(got ^ want))
        assert want <= old_keep_row(*row) or ambiguous(*row), (b, sorted(want - old_keep_row(*row)))
        differs += want != old_keep_row(*row)
    assert differs >= 16  # the combined rows above, at least, tell the orders apart


def test_kernel_follows_vllm_order_with_combined_filters():
    """A few rows, each drawn with several seeds: ids equal the reference's, lie in the vLLM-order
    kept set, and the draws include tokens the old intersection would have picked differently."""
    rows, seeds_per_row, V = 3, 2, 64  # each simulated row costs ~2 s (two bisections)
    base = torch.randn(rows, V) * (torch.rand(rows, 1) * 0.6 + 0.3)  # flat: many tokens matter
    filters = torch.tensor(
        [[30, 0.3, 0.0], [0, 0.5, 0.3], [20, 0.6, 0.2], [12, 0.35, 0.0], [0, 0.45, 0.25]]
    )
    perm = torch.randperm(len(filters))[:rows]
    n = rows * seeds_per_row
    logits = base.repeat_interleave(seeds_per_row, 0)
    temp = (torch.rand(rows) * 0.6 + 0.7).repeat_interleave(seeds_per_row)
    top_k = filters[perm, 0].to(torch.int32).repeat_interleave(seeds_per_row)
    top_p = filters[perm, 1].repeat_interleave(seeds_per_row)
    min_p = filters[perm, 2].repeat_interleave(seeds_per_row)
    scaled = logits / temp[:, None]

    def old_draw_differs(b: int, seeds: torch.Tensor, positions: torch.Tensor, new: int) -> bool:
        """Whether the old semantics' draw with row b's noise differs from `new`."""
        row = (scaled[b].double(), int(top_k[b]), float(top_p[b]), float(min_p[b]))
        if ambiguous(*row):
            return False
        u = sampling.seeded_uniform_ref(seeds[b : b + 1], positions[b : b + 1], V)[0]
        old = torch.full((V,), float("-inf"))
        old_ids = sorted(old_keep_row(*row))
        old[old_ids] = scaled[b, old_ids] - torch.log(-torch.log(u[old_ids]))
        return int(old.argmax()) != new

    # Seeds chosen (with the reference, cheaply) so that some draw tells the orders apart:
    # a property of these rows by construction, not a hope about one draw.
    for _ in range(200):
        seeds = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64)
        positions = torch.randint(0, 5000, (n,), dtype=torch.int64)
        args = (logits, temp, top_k, top_p, min_p, seeds, positions)
        ref = sampling.sample_ref(*args)
        if any(old_draw_differs(b, seeds, positions, int(ref[b])) for b in range(n)):
            break
    else:
        raise AssertionError("no seeds whose draws tell the old and the vLLM order apart")
    got = sample_sim(*args)
    check_rows(args, got, ref)
    for b in range(n):
        row = (scaled[b].double(), int(top_k[b]), float(top_p[b]), float(min_p[b]))
        if not ambiguous(*row):
            assert int(got[b]) in vllm_keep_row(*row), b
    # got equals ref (check_rows), so the kernel's draws include one the old order would not make
    assert any(old_draw_differs(b, seeds, positions, int(got[b])) for b in range(n))


def test_sample_matches_reference_mixed_rows():
    V = 160
    logits = torch.randn(7, V) * 3
    logits[1, 40:45] = float("-inf")  # masked tokens (logit bias / min_tokens)
    temp = torch.tensor([0.0, 0.8, 1.0, 1.3, 0.6, 1.0, 2.0])
    top_k = torch.tensor([0, 0, 7, 0, 20, 1, 50], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.7, 0.9, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1])
    seeds = torch.randint(-(2**62), 2**62, (7,), dtype=torch.int64)
    positions = torch.randint(0, 5000, (7,), dtype=torch.int64)
    args = (logits, temp, top_k, top_p, min_p, seeds, positions)
    got = sample_sim(*args)
    check_rows(args, got, sampling.sample_ref(*args))


def test_sample_ties_go_by_id():
    """Logits on a coarse grid tie often: top-k's and top-p's boundary ties (top-p over what top-k
    and min-p keep) must keep the lowest ids, as the reference's stable sort does, and greedy
    ties pick the lowest id."""
    V = 120
    logits = torch.randint(-4, 4, (5, V)).float() * 0.5
    temp = torch.tensor([0.0, 1.0, 0.9, 1.1, 1.0])
    top_k = torch.tensor([0, 3, 10, 25, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.5, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0])
    seeds = torch.randint(0, 2**31, (5,), dtype=torch.int64)
    positions = torch.arange(5, dtype=torch.int64)
    args = (logits, temp, top_k, top_p, min_p, seeds, positions)
    got = sample_sim(*args)
    check_rows(args, got, sampling.sample_ref(*args))
    assert int(got[0]) == int(logits[0].argmax())


def test_argmax_ties_lowest_id():
    logits = torch.randn(4, 150)
    logits[2, 17] = logits[2, 99] = logits[2].max() + 1
    logits[3] = float("-inf")
    out = torch.full((4,), -7, dtype=torch.int64)
    launch(sampling.argmax_kernel, 4, BLOCK, np_args(logits, out))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_apply_penalties():
    B, V = 3, 130
    logits = torch.randn(B, V) * 4
    prompt_mask = torch.rand(B, V) < 0.2
    counts = torch.randint(0, 3, (B, V), dtype=torch.int32) * (torch.rand(B, V) < 0.3)
    counts = counts.to(torch.int32)
    rep = torch.tensor([1.0, 1.3, 0.8])
    pres = torch.tensor([0.0, 0.5, -0.2])
    freq = torch.tensor([0.0, 0.3, 0.1])
    ref = logits.clone()
    sampling.apply_penalties_ref(ref, prompt_mask, counts, rep, pres, freq)
    grid = (B, (V + BLOCK - 1) // BLOCK)
    launch(
        sampling.apply_penalties_kernel,
        grid,
        BLOCK,
        np_args(logits, prompt_mask, counts, rep, pres, freq),
    )
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-6)


def test_seeded_noise_matches_reference_hash():
    """The kernel's hash and uniform->Gumbel path, isolated: a flat row with top-k off samples
    argmax(gumbel), which must be the reference's for many seeds."""
    n, V = 6, 64
    logits = torch.zeros(n, V)
    ones = torch.ones(n)
    args = (
        logits,
        ones,
        torch.zeros(n, dtype=torch.int32),
        ones,
        torch.zeros(n),
        torch.tensor(np.random.randint(-(2**63), 2**63 - 1, n, dtype=np.int64)),
        torch.randint(0, 2**40, (n,), dtype=torch.int64),
    )
    assert sample_sim(*args).tolist() == sampling.sample_ref(*args).tolist()


def test_top_uniform_code_is_below_one_and_masked_tokens_never_win():
    """The draw that once sampled a grammar-masked token: seed 285599134 at output position 155
    hashes vocabulary entry 318 to the top code (h >> 8 = 2^24 - 1), whose uniform rounded to
    1.0 in fp32 (Gumbel +inf: -inf + inf = NaN won argmax). The uniform stays below 1.0, and with
    318 masked, reference and kernel draw one of the allowed tokens."""
    V, tok = 384, 318
    seeds, positions = torch.tensor([285599134]), torch.tensor([155])
    u = sampling.seeded_uniform_ref(seeds, positions, V)
    assert float(u[0, tok]) == sampling.U_MAX < 1.0
    assert float(u.max()) < 1.0 and torch.isfinite(-torch.log(-torch.log(u))).all()
    logits = torch.full((1, V), float("-inf"))
    allowed = [4, 200, 201, 204, 223]
    logits[0, allowed] = torch.tensor([-1.16, 0.76, 0.65, 0.23, 2.80])
    one = torch.ones(1)
    args = (logits, one, torch.zeros(1, dtype=torch.int32), one, torch.zeros(1), seeds, positions)
    ref = sampling.sample_ref(*args)
    assert int(ref[0]) in allowed
    assert sample_sim(*args).tolist() == ref.tolist()
    # Unmasked, the top-code token gets the largest finite noise, not an unconditional win.
    flat = torch.zeros(1, V)
    assert int(sampling.sample_ref(flat, *args[1:])[0]) == tok
