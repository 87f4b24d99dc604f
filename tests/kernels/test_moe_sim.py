"""The MoE kernels (kernels/moe/decode.py, kernels/moe/grouped.py) and the routing ops
(kernels/moe/routing.py) against their torch references, in the CUDA simulator: fresh random
inputs (seed printed), NaN-poisoned outputs, fp32 and fp16, an expert that receives no token and
one that receives every token."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.moe import decode as moe_decode
from voltserve.kernels.moe import grouped as moe_grouped
from voltserve.kernels.moe.experts import moe_experts_ref
from voltserve.kernels.moe.routing import max_tiles, moe_align_ref, moe_topk_ref
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


@pytest.fixture
def rng() -> random.Random:
    """Fresh draws every run; the seed is printed (replay: VOLTSERVE_TEST_SEED=<seed>)."""
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return random.Random(seed)


def _weights(gen, E, H, inter, dtype):
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2


def _routing(gen, T, E, k, all_to=None, skip=None):
    """Random distinct top-k ids per token; `all_to` is in every token's set; `skip` in none."""
    ids = torch.empty(T, k, dtype=torch.int32)
    pool = [e for e in range(E) if e != skip and e != all_to]
    for t in range(T):
        perm = torch.randperm(len(pool), generator=gen)[: k - (all_to is not None)].tolist()
        row = [pool[i] for i in perm] + ([all_to] if all_to is not None else [])
        ids[t] = torch.tensor(row, dtype=torch.int32)[torch.randperm(k, generator=gen)]
    w = torch.rand(T, k, generator=gen)
    return w / w.sum(-1, keepdim=True), ids


def _close(out, ref):
    assert not torch.isnan(out.float()).any(), "kernel left poisoned (NaN) outputs"
    tol = 2e-3 if out.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_gate_up_kernel(rng, dtype):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # H: no full 1024-step, a tail of 2 chunks (one partial); inter: one simulated warp per
    # column of each pair, two columns (the second one's gate and up rows offset by j)
    T, E, k, H, inter = 2, 5, 2, 264, 2
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13, _ = _weights(gen, E, H, inter, dtype)
    _, ids = _routing(gen, T, E, k, skip=4)
    h = torch.full((T * k, inter), float("nan"), dtype=dtype)
    args = (x.numpy(), w13.numpy(), ids.numpy(), h.numpy())
    launch(moe_decode.moe_decode_gate_up_kernel, moe_decode.gate_up_grid(T * k, inter), 32, args)
    tok = torch.arange(T * k) // k
    want = torch.stack(
        [silu_and_mul_ref(F.linear(x[tok[p]][None], w13[ids.view(-1)[p]]))[0] for p in range(T * k)]
    )
    _close(h, want)


def test_decode_gate_up_full_step(rng):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, E, k, H, inter = 1, 3, 2, 1024 + 8, 2  # one unguarded step, then one tail chunk
    x = torch.randn(T, H, generator=gen)
    w13, _ = _weights(gen, E, H, inter, torch.float32)
    ids = torch.tensor([[2, 0]], dtype=torch.int32)
    h = torch.full((T * k, inter), float("nan"))
    args = (x.numpy(), w13.numpy(), ids.numpy(), h.numpy())
    launch(moe_decode.moe_decode_gate_up_kernel, moe_decode.gate_up_grid(T * k, inter), 32, args)
    want = torch.cat([silu_and_mul_ref(F.linear(x, w13[e])) for e in (2, 0)])
    _close(h, want)


@pytest.mark.parametrize(
    "dtype,inter,warps",
    [
        (torch.float32, 16, 1),
        (torch.float16, 16, 1),
        (torch.float32, 1032, 1),  # 1032 (k=2): one full 8-chunk step and a tail
        (torch.float16, 1032, 1),
        # Two warps split a row pair's chunks (the GPU runs 4): 2064 (k=2) is one full step
        # of the block and a tail that only the first warp has chunks of.
        (torch.float16, 2064, 2),
    ],
)
def test_decode_down_kernel(rng, dtype, inter, warps, monkeypatch):
    monkeypatch.setattr(moe_decode, "WARPS", warps)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, E, k, H = 2, 4, 2, 4  # two row pairs
    h = torch.randn(T * k, inter, generator=gen).to(dtype)
    _, w2 = _weights(gen, E, H, inter, dtype)
    wts, ids = _routing(gen, T, E, k, all_to=1)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    args = (h.numpy(), w2.numpy(), ids.numpy(), wts.numpy(), out.numpy())
    launch(moe_decode.moe_decode_down_kernel, moe_decode.down_grid(T, H), 32 * warps, args)
    want = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            want[t] += wts[t, s] * F.linear(h[t * k + s].float(), w2[ids[t, s]].float())
    _close(out, want)


# (E, k, T, renormalise, logits dtype, weights rounded through it): every E with every k, each
# T of 1 (a block of one live warp), 3 (one block: the three row kinds, one idle warp) and 33
# (nine blocks, the last with one live warp), each weights form (fp32 logits; fp16 logits with
# the Qwen families' fp16 weights or Mixtral's fp32 ones) and renormalisation on and off.
F16, F32 = torch.float16, torch.float32
TOPK_CASES = [
    (8, 1, 1, True, F32, False),
    (8, 2, 3, True, F16, False),  # Mixtral (fp16 activations, fp32 weights)
    (8, 4, 3, False, F16, True),
    (8, 8, 1, True, F16, True),  # every expert: the last ones tie at probability 0
    (60, 1, 3, False, F32, False),
    (60, 2, 1, True, F16, True),
    (60, 4, 33, False, F16, True),  # Qwen2-MoE
    (60, 8, 3, True, F32, False),
    (64, 1, 3, True, F16, True),
    (64, 2, 3, False, F32, False),
    (64, 4, 1, True, F16, False),
    (64, 8, 3, False, F16, True),
    (128, 1, 1, False, F16, False),
    (128, 2, 3, True, F16, True),
    (128, 4, 3, False, F32, False),
    (128, 8, 33, True, F16, True),  # Qwen3-MoE
]


def _case_id(case) -> str:
    E, k, T, renorm, dtype, rnd = case
    w = "w16" if rnd else "w32"
    return f"E{E}-k{k}-T{T}-{'renorm' if renorm else 'raw'}-{str(dtype)[6:]}-{w}"


@pytest.mark.parametrize("E,k,T,renorm,dtype,rnd", TOPK_CASES, ids=map(_case_id, TOPK_CASES))
def test_topk_kernel_matches_reference(rng, E, k, T, renorm, dtype, rnd):
    from voltserve.kernels.moe.routing import TOPK_THREADS, moe_topk_kernel, topk_grid

    from tests.moe_topk_cases import router_logits, topk_by_rule, weight_tolerance

    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = router_logits(gen, T, E, dtype)
    w = torch.full((T, k), float("nan"))
    ids = torch.full((T, k), -1, dtype=torch.int32)
    args = (logits.numpy(), w.numpy(), ids.numpy(), renorm, rnd)
    launch(moe_topk_kernel, topk_grid(T), TOPK_THREADS, args)
    # Exact ties (equal logits) go to the lowest expert index: torch.topk, which the reference
    # follows as transformers does, leaves their order open, so the ids are checked against that
    # rule and the weights (equal where probabilities tie) against the reference.
    assert torch.equal(ids, topk_by_rule(logits, k))
    want_w, _ = moe_topk_ref(logits, k, renorm, dtype if rnd else None)
    assert not torch.isnan(w).any(), "kernel left poisoned (NaN) weights"
    torch.testing.assert_close(w, want_w, **weight_tolerance(rnd))
    if T >= 3 and k > 2 and E > 2:
        assert (w[2, 2:] == 0).all()  # row kind 2: the rest underflow to exactly 0


# The simulator computes -inf - -inf and inf - inf in numpy, which warns.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_topk_kernel_ids_stay_in_range_on_nan_rows(rng):
    """A NaN or +inf logit (or a row of -inf) makes torch's softmax NaN; the kernel still writes
    k distinct ids within 0..E-1 (the expert kernels index weights by them) and every weight."""
    from voltserve.kernels.moe.routing import TOPK_THREADS, moe_topk_kernel, topk_grid

    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, E, k = 3, 60, 4
    logits = torch.randn(T, E, generator=gen)
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    w = torch.full((T, k), float("nan"))
    ids = torch.full((T, k), -1, dtype=torch.int32)
    launch(
        moe_topk_kernel,
        topk_grid(T),
        TOPK_THREADS,
        (logits.numpy(), w.numpy(), ids.numpy(), False, False),
    )
    assert ((ids >= 0) & (ids < E)).all() and all(len(set(r)) == k for r in ids.tolist())
    assert not torch.isnan(w).any()


def test_moe_topk_ref_matches_transformers_routing():
    torch.manual_seed(0)
    logits = torch.randn(7, 6)
    w, ids = moe_topk_ref(logits, 3, renormalize=True)
    probs = torch.softmax(logits.float(), -1)
    v, i = torch.topk(probs, 3, -1)
    assert torch.equal(ids, i.int()) and torch.allclose(w, v / v.sum(-1, keepdim=True))
    w2, _ = moe_topk_ref(logits.half(), 3, renormalize=False, weights_dtype=torch.float16)
    assert w2.dtype == torch.float32
    assert torch.equal(
        w2, torch.topk(torch.softmax(logits.half().float(), -1), 3)[0].half().float()
    )


def test_align_groups_pairs_by_expert(rng):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, E, k, bm = 21, 6, 2, 4
    _, ids = _routing(gen, T, E, k, all_to=0, skip=5)
    order, start, first, tile_expert = moe_align_ref(ids, E, bm)
    flat = ids.view(-1).long()
    assert sorted(order.tolist()) == list(range(T * k))
    assert torch.equal(flat[order.long()], flat.sort(stable=True).values)
    counts = torch.bincount(flat, minlength=E)
    assert start.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert tile_expert.numel() == max_tiles(T * k, E, bm)
    # every expert's rows are covered by its tiles exactly once
    rows = []
    for t, e in enumerate(tile_expert.tolist()):
        if e < E:
            r0 = start[e] + (t - first[e]) * bm
            rows += list(range(r0, min(r0 + bm, start[e + 1])))
    assert rows == list(range(T * k))
    assert (counts[5] == 0) and counts[0] == T


def _run_grouped(x, w13, w2, wts, ids):
    T, H = x.shape
    k = ids.shape[1]
    E, inter = w2.shape[0], w2.shape[2]
    P = T * k
    order, start, first, tile_expert = moe_align_ref(ids, E, moe_grouped.BM)
    tiles = tile_expert.shape[0]
    h = torch.full((P, inter), float("nan"), dtype=x.dtype)
    y = torch.full((P, H), float("nan"))
    meta = (order.numpy(), start.numpy(), first.numpy(), tile_expert.numpy())
    g = (tiles, -(-inter // moe_grouped.BN_PAIRS))
    launch(
        moe_grouped.moe_grouped_gate_up_kernel,
        g,
        moe_grouped.THREADS,
        (x.numpy(), w13.numpy(), *meta, k, h.numpy()),
    )
    assert not torch.isnan(h.float()).any(), "gate_up left poisoned rows"
    g = (tiles, -(-H // moe_grouped.BN))
    launch(
        moe_grouped.moe_grouped_down_kernel,
        g,
        moe_grouped.THREADS,
        (h.numpy(), w2.numpy(), *meta, wts.reshape(-1).numpy(), y.numpy()),
    )
    return y.view(T, k, H).sum(1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_kernels_match_reference(rng, dtype):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # H = 72: two K stages (one guarded) and two column blocks of the down GEMM; I = 40: two
    # gate_up column blocks (one partial); expert 0 gets all 18 tokens (two tiles), expert 3
    # none.
    T, E, k, H, inter = 18, 4, 2, 72, 40
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13, w2 = _weights(gen, E, H, inter, dtype)
    wts, ids = _routing(gen, T, E, k, all_to=0, skip=3)
    _close(_run_grouped(x, w13, w2, wts, ids), moe_experts_ref(x, w13, w2, wts, ids))


def test_reference_against_dense_loop(rng):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, E, k, H, inter = 5, 4, 3, 16, 8
    x = torch.randn(T, H, generator=gen)
    w13, w2 = _weights(gen, E, H, inter, torch.float32)
    wts, ids = _routing(gen, T, E, k)
    want = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            want[t] += wts[t, s] * (w2[e] @ silu_and_mul_ref((w13[e] @ x[t])[None])[0])
    torch.testing.assert_close(moe_experts_ref(x, w13, w2, wts, ids), want, atol=1e-5, rtol=1e-5)


def test_dispatch_resolves_moe_ops_and_their_capture(monkeypatch):
    from voltserve.kernels.dispatch import KernelDispatch

    ops = ("moe_topk", "moe_experts")
    monkeypatch.delenv("VOLTSERVE_MOE_TOPK", raising=False)
    cpu = KernelDispatch("cpu", torch.float32)
    assert cpu.impl["moe_experts"] == "ref" and cpu.impl["moe_topk"] == "ref"
    cuda = KernelDispatch("cuda", torch.float16)  # resolving touches no device
    assert cuda.impl["moe_experts"] == "cuda" and cuda.impl["moe_topk"] == "cuda"
    assert cuda.capturable(ops)
    monkeypatch.setenv("VOLTSERVE_MOE_TOPK", "0")
    off = KernelDispatch("cuda", torch.float16)
    assert off.impl["moe_topk"] == "ref" and off.capturable(ops)  # torch.topk never syncs
    # numba has no bf16: the experts' reference loops with a host sync, so no decode graphs
    assert not KernelDispatch("cuda", torch.bfloat16).capturable(ops)
