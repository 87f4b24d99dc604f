"""The pre-norm GEMVs (kernels/gemv.py's prologue: residual add + RMSNorm folded into the plain,
gate_up and qkv_rope GEMVs) against their references in the CUDA simulator: M = 1 and 2, fp16 and
fp32, odd output counts, K not a multiple of the warp's 256-element chunk, outputs and
residual_out poisoned with NaN, fresh random inputs (tests/conftest.py seeds torch per test and
prints VOLTSERVE_TEST_SEED on a failure); and the host side (supports_prenorm, the launchers'
fallback, dispatch).

Sizes are small (the simulator runs a Python thread per GPU thread): K = 264 leaves the first
(peeled) step partial, and K = 2056 at R = 2, U = 4 runs the first step, one full loop step and a
guarded tail."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from voltserve.kernels import gemv, gemv_qkv_rope
from voltserve.kernels.numba_common import SIM
from voltserve.kernels.rotary import build_cos_sin_cache

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
EPS = 1e-5

# Tolerances on the linear's output (the normalised input itself is compared exactly, through
# residual_out and the shared reference xn): the kernel sums in fp32 in another order than
# torch, and fp16 outputs are rounded once from that sum (half an ulp, 4.9e-4 relative), as in
# test_gemv_sim.py; gate_up and qkv_rope round twice (the product, then silu or the rotation),
# as in test_gemv_sim.py / test_gemv_qkv_rope_sim.py.
TOL = {
    (gemv.PLAIN, torch.float16): dict(atol=2e-3, rtol=2e-3),
    (gemv.GATE_UP, torch.float16): dict(atol=4e-3, rtol=4e-3),
    (gemv.QKV_ROPE, torch.float16): dict(atol=8e-3, rtol=8e-3),
}
FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def _short_gil_slices():
    """The simulator's block manager busy-polls its threads (a Python thread per GPU thread)
    until all reach a barrier; with the default 5 ms GIL slice, every barrier (the prologue's
    reduction, each simulated shuffle) costs whole slices. 0.5 ms makes these tests ~6x faster
    (a qkv_rope case: 8.6 s -> 1.3 s on one core)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(before)


def make(dtype, M, K, rows, with_bias):
    x = torch.randn(M, K).to(dtype)
    residual = (torch.randn(M, K) * 2).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(K)).to(dtype)
    w = (torch.randn(rows, K) * 2 / K**0.5).to(dtype)  # gate over silu's curve
    bias = torch.randn(rows).to(dtype) if with_bias else None
    return x, residual, norm_w, w, bias


def make_rope(dtype, M, n_q, n_kv, D, block_size=4, num_blocks=3):
    positions = torch.randint(1, 64, (M,), dtype=torch.int64)
    slots = torch.randperm(num_blocks * block_size)[:M].to(torch.int64)
    if M > 1:
        slots[1] = -1  # a padding row: rotated into out, never written to the cache
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}
    cache = build_cos_sin_cache(D, 64, 10000.0, scaling)
    k_cache = torch.randn(num_blocks, n_kv, block_size, D).to(dtype)
    v_cache = torch.randn(num_blocks, n_kv, block_size, D).to(dtype)
    return positions, cache, k_cache, v_cache, slots, n_q, n_kv


def units(kind, rows):
    """Warps the kernel needs: one per row (plain, R = 1 at M <= 2) or per row pair."""
    return rows if kind == gemv.PLAIN else rows // 2


def run_kernel(kind, x, residual, norm_w, w, bias, rope=(), warps=1, extra_blocks=0):
    """One launch of the pre-norm kernel with `warps`-warp blocks (the simulator's shuffles are
    exact when every warp of a block runs the same shuffles; warps past the last row leave after
    the prologue). Returns (out, residual_out), both poisoned with NaN beforehand."""
    M, rows = x.shape[0], w.shape[0]
    out = torch.full((M, rows // 2 if kind == gemv.GATE_UP else rows), float("nan"), dtype=x.dtype)
    residual_out = torch.full_like(x, float("nan"))
    b = bias if bias is not None else w[0]
    np_ = [t.numpy() for t in (x, w, b, out)]
    rope_ = [a.numpy() if isinstance(a, torch.Tensor) else a for a in rope]
    norm_ = (residual.numpy(), norm_w.numpy(), np.float32(EPS), residual_out.numpy())
    grid = (units(kind, rows) + warps - 1) // warps + extra_blocks
    smem = M * x.shape[1] * x.element_size()
    args = (*np_, bias is not None, *rope_, *norm_)
    gemv._launch_smem(gemv.gemv_kernel(M, kind, True), grid, 32 * warps, args, 0, smem)
    return out, residual_out


def reference(kind, x, residual, norm_w, w, bias, rope=()):
    """(linear output, residual + x, the rope caches after the step). xn comes from the op's
    own pre-norm reference in the storage dtype; the linear is then taken in fp32 (as the GEMV
    sim tests do: torch's CPU fp16 linear is no fp32-sum-then-round reference) and, where the
    unfused ops store it, rounded to the storage dtype."""
    dtype = x.dtype
    res_ref = torch.empty_like(x)
    xn = gemv.prenorm_ref(x, residual, norm_w, EPS, res_ref).float()
    wf, bf = w.float(), None if bias is None else bias.float()
    if kind == gemv.PLAIN:
        return gemv.gemv_ref(xn, wf, bf), res_ref, ()
    if kind == gemv.GATE_UP:
        from voltserve.kernels.activation import silu_and_mul_ref

        y = gemv.gemv_ref(xn, wf, bf).to(dtype)
        return silu_and_mul_ref(y.float()).to(dtype).float(), res_ref, ()
    positions, cache, k_cache, v_cache, slots, n_q, n_kv = rope
    kc, vc = k_cache.float(), v_cache.float()
    out = gemv_qkv_rope.gemv_qkv_rope_ref(xn, wf, bf, positions, cache, kc, vc, slots, n_q, n_kv)
    return out, res_ref, (kc, vc)


def check(kind, x, residual, norm_w, w, bias, rope=(), **launch):
    dtype = x.dtype
    rope_kernel = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rope)
    out, residual_out = run_kernel(kind, x, residual, norm_w, w, bias, rope_kernel, **launch)
    ref, res_ref, caches = reference(kind, x, residual, norm_w, w, bias, rope)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # residual + x in the storage dtype, bit for bit (what fused_add_rms_norm stores)
    assert torch.equal(residual_out, res_ref)
    assert torch.equal(residual_out, residual + x)
    tol = TOL[kind, dtype] if dtype == torch.float16 else FP32_TOL
    torch.testing.assert_close(out.float(), ref, **tol)
    if caches:  # compared whole: only the slots of non-padding rows were written
        for got, want in zip(rope_kernel[2:4], caches):
            torch.testing.assert_close(got.float(), want, **tol)


# (M, K, rows, bias, dtype); rows odd where the kind allows (plain: N; gate_up: I = rows / 2)
@sim_only
@pytest.mark.parametrize(
    "M,K,N,with_bias,dtype",
    [(1, 264, 5, True, torch.float16), (2, 264, 3, False, torch.float32)],
)
def test_plain_prenorm(M, K, N, with_bias, dtype):
    x, residual, norm_w, w, bias = make(dtype, M, K, N, with_bias)
    check(gemv.PLAIN, x, residual, norm_w, w, bias)


@sim_only
def test_plain_prenorm_multiwarp_blocks_and_idle_blocks():
    # Two-warp blocks: the prologue's reduction spans warps, the last block's second warp has no
    # row (it must pass the barriers, then leave), and one whole block past the rows runs only
    # the prologue. M = 2 in fp16, K with a partial first step.
    x, residual, norm_w, w, bias = make(torch.float16, 2, 136, 3, True)
    check(gemv.PLAIN, x, residual, norm_w, w, bias, warps=2, extra_blocks=1)


@sim_only
@pytest.mark.parametrize(
    "M,K,inter,with_bias,dtype",
    # K = 2056: the peeled first step, one full loop step and a guarded tail (step 1024)
    [(1, 2056, 3, False, torch.float16), (2, 264, 3, True, torch.float32)],
)
def test_gate_up_prenorm(M, K, inter, with_bias, dtype):
    x, residual, norm_w, w, bias = make(dtype, M, K, 2 * inter, with_bias)
    check(gemv.GATE_UP, x, residual, norm_w, w, bias)


@sim_only
@pytest.mark.parametrize(
    "M,K,with_bias,dtype",
    [(1, 264, True, torch.float32), (2, 264, False, torch.float16)],
)
def test_qkv_rope_prenorm(M, K, with_bias, dtype):
    # head_dim 4, 2 q heads and 1 kv head: 8 rotary pairs (one simulated warp each)
    n_q, n_kv, D = 2, 1, 4
    x, residual, norm_w, w, bias = make(dtype, M, K, (n_q + 2 * n_kv) * D, with_bias)
    check(gemv.QKV_ROPE, x, residual, norm_w, w, bias, make_rope(dtype, M, n_q, n_kv, D))


@sim_only
def test_launcher_runs_the_kernel(monkeypatch):
    """gemv_prenorm_cuda / launch_gemv end to end in the simulator: the argument order, the
    dynamic shared memory size, the output it allocates, with two-warp blocks."""
    monkeypatch.setattr(gemv, "PRENORM_WARPS", 2)
    monkeypatch.setattr(gemv, "dev", lambda t: t.numpy())
    monkeypatch.setattr(gemv, "current_stream", lambda: 0)
    monkeypatch.setattr(gemv, "supports", lambda x, w: True)
    monkeypatch.setattr(gemv, "supports_prenorm", lambda *a: True)
    x, residual, norm_w, w, bias = make(torch.float16, 2, 72, 6, True)
    residual_out = torch.full_like(x, float("nan"))
    for fn, kind in ((gemv.gemv_prenorm_cuda, gemv.PLAIN), (gemv.gemv_gate_up_prenorm_cuda, None)):
        out = fn(x, residual, norm_w, EPS, w, bias, residual_out=residual_out)
        ref, res_ref, _ = reference(kind or gemv.GATE_UP, x, residual, norm_w, w, bias)
        assert torch.equal(residual_out, res_ref)
        torch.testing.assert_close(out.float(), ref, **TOL[kind or gemv.GATE_UP, x.dtype])
        residual_out.fill_(float("nan"))


# ---- host side ----------------------------------------------------------------------------


def test_references_compose_the_unfused_ops():
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_ref

    x, residual, norm_w, w, bias = make(torch.float32, 2, 32, 12, True)
    xn, r = x.clone(), residual.clone()
    fused_add_rms_norm_ref(xn, r, norm_w, EPS)
    res_out = torch.empty_like(x)
    out = gemv.gemv_prenorm_ref(x, residual, norm_w, EPS, w, bias, residual_out=res_out)
    assert torch.equal(res_out, r) and torch.equal(out, gemv.gemv_ref(xn, w, bias))
    out = gemv.gemv_gate_up_prenorm_ref(x, residual, norm_w, EPS, w, bias, residual_out=res_out)
    assert torch.equal(out, gemv.gemv_gate_up_ref(xn, w, bias))
    # residual_out may alias residual on the reference path (the in-place layer update)
    r2 = residual.clone()
    gemv.gemv_prenorm_ref(x, r2, norm_w, EPS, w, bias, residual_out=r2)
    assert torch.equal(r2, r)


def test_qkv_rope_launcher_falls_back_to_the_reference():
    n_q, n_kv, D = 2, 1, 8
    x, residual, norm_w, w, bias = make(torch.float32, 2, 24, (n_q + 2 * n_kv) * D, True)
    rope = make_rope(torch.float32, 2, n_q, n_kv, D)
    rope2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rope)
    r1, r2 = torch.empty_like(x), torch.empty_like(x)
    out1 = torch.empty(2, w.shape[0])
    got = gemv_qkv_rope.gemv_qkv_rope_prenorm_cuda(
        x, residual, norm_w, EPS, w, bias, *rope, residual_out=r1, out=out1
    )
    want = gemv_qkv_rope.gemv_qkv_rope_prenorm_ref(
        x, residual, norm_w, EPS, w, bias, *rope2, residual_out=r2
    )
    assert got is out1 and torch.equal(got, want) and torch.equal(r1, r2)
    assert torch.equal(rope[2], rope2[2]) and torch.equal(rope[3], rope2[3])


def test_prenorm_checks(monkeypatch):
    """supports_prenorm on CPU tensors (is_cuda patched to pass): what the kernel can take."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    x = torch.randn(2, 64, dtype=torch.float16)
    r, nw, ro = torch.randn_like(x), torch.randn(64, dtype=torch.float16), torch.empty_like(x)
    assert gemv.supports_prenorm(x, r, nw, ro)
    assert gemv.supports_prenorm(x[:1], r[:1], nw, ro[:1])
    assert not gemv.supports_prenorm(torch.randn(3, 64, dtype=torch.float16), r, nw, ro)  # M = 3
    assert not gemv.supports_prenorm(x, r, nw, r)  # residual_out aliases residual
    assert not gemv.supports_prenorm(x, r, nw, x)  # ... or x
    assert not gemv.supports_prenorm(x, r, nw, ro, out=x)  # out overlaps an input
    assert not gemv.supports_prenorm(x, r, nw.float(), ro)  # dtype mismatch
    assert not gemv.supports_prenorm(x, r, nw[:32], ro[:, :32])  # shapes differ
    big = torch.empty(2, 12288, dtype=torch.float16)  # 48 KiB of rows + the scratch: too much
    assert not gemv.supports_prenorm(big, big.clone(), big[0].clone(), big.clone())
    ok = torch.empty(1, 12288, dtype=torch.float16)  # 24 KiB
    assert gemv.supports_prenorm(ok, ok.clone(), ok[0].clone(), ok.clone())
    odd = torch.randn(2, 72, dtype=torch.float16)[:, 4:68]  # rows not 16-byte aligned
    assert not gemv.supports_prenorm(odd, r, nw, ro)
    with pytest.raises(ValueError, match="pre-norm"):
        gemv._source(4, 2, 4, gemv.PLAIN, prenorm=True)


def test_dispatch_resolves_the_prenorm_ops(monkeypatch):
    from voltserve.kernels.dispatch import KernelDispatch

    monkeypatch.delenv("VOLTSERVE_FORCE_REF", raising=False)
    ops = ("gemv_prenorm", "gemv_gate_up_prenorm", "gemv_qkv_rope_prenorm")
    cpu, cuda = KernelDispatch("cpu"), KernelDispatch("cuda")  # resolving touches no device
    for op in ops:
        assert cpu.impl[op] == "ref" and cuda.impl[op] == "cuda"
    assert cpu.gemv_prenorm is gemv.gemv_prenorm_ref
    assert cuda.gemv_gate_up_prenorm is gemv.gemv_gate_up_prenorm_cuda
    assert cuda.gemv_qkv_rope_prenorm is gemv_qkv_rope.gemv_qkv_rope_prenorm_cuda
