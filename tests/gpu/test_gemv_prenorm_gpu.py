"""The pre-norm GEMVs (kernels/gemv.py's prologue: the residual add and RMSNorm folded into the
plain, gate_up and qkv_rope GEMVs) on a real GPU at Llama-3-8B and Qwen2.5-0.5B shapes, M = 1
and 2: against their references (in fp32 after the storage-dtype norm) and against the launches
they replace (fused_add_rms_norm_cuda, then the GEMV), with NaN-poisoned outputs, residual_out
and caches; one CUDA-graph capture of a layer's two fused launches; the shared-memory bound."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
NAN = float("nan")
# (K, n_q, n_kv, head_dim, intermediate, bias, eps): Llama-3-8B (qkv N = 6144, gate_up
# 2 x 14336; K = 4096 is whole steps), Qwen2.5-0.5B (K = 896: a guarded step; qkv bias).
SHAPES = [(4096, 32, 8, 128, 14336, False, 1e-5), (896, 14, 2, 64, 4864, True, 1e-6)]
# fp32 sums in another order than the reference, one or two roundings to fp16 at |y| ~ 1, and
# now and then an element of xn an ulp apart (1/rms from another summation order): well
# inside these.
TOL = dict(atol=1e-2, rtol=1e-2)
ROPE_TOL = dict(atol=2e-2, rtol=2e-2, equal_nan=True)  # as test_gemv_qkv_rope_gpu.py


def _norm_inputs(M: int, K: int):
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    residual = (torch.randn(M, K, device=DEV) * 4).to(torch.float16)
    norm_w = (1 + 0.1 * torch.randn(K, device=DEV)).to(torch.float16)
    return x, residual, norm_w, torch.full_like(x, NAN)


def _weight(rows: int, K: int, with_bias: bool):
    w = torch.empty(rows, K, device=DEV, dtype=torch.float16).normal_(0, 0.02)
    b = torch.randn(rows, device=DEV, dtype=torch.float16) if with_bias else None
    return w, b


def _unfused(x, residual, norm_w, eps):
    """What the fused launch replaces: fused_add_rms_norm_cuda (on copies) -> (xn, residual)."""
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_cuda

    xn, r = x.clone(), residual.clone()
    fused_add_rms_norm_cuda(xn, r, norm_w, eps)
    return xn, r


def _xn_ref(x, residual, norm_w, eps):
    """(xn, residual + x) from the reference pre-norm, in the storage dtype."""
    from voltserve.kernels.gemv import prenorm_ref

    r = torch.empty_like(x)
    return prenorm_ref(x, residual, norm_w, eps, r), r


def _check_residual(residual_out, x, residual, r_unfused):
    # residual + x in fp16, bit for bit, as fused_add_rms_norm stores it
    assert torch.equal(residual_out, residual + x)
    assert torch.equal(residual_out, r_unfused)


def _f(t):
    return None if t is None else t.float()


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_plain_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    from voltserve.kernels.gemv import gemv_cuda, gemv_prenorm_cuda, supports_prenorm

    x, residual, norm_w, ro = _norm_inputs(M, K)
    w, b = _weight((n_q + 2 * n_kv) * D, K, with_bias)
    assert supports_prenorm(x, residual, norm_w, ro)
    x0, r0 = x.clone(), residual.clone()
    out = torch.full((M, w.shape[0]), NAN, device=DEV, dtype=torch.float16)
    got = gemv_prenorm_cuda(x, residual, norm_w, eps, w, b, residual_out=ro, out=out)
    xn, _ = _xn_ref(x0, r0, norm_w, eps)
    xn_u, r_u = _unfused(x0, r0, norm_w, eps)
    unf = gemv_cuda(xn_u, w, b)
    torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    _check_residual(ro, x0, r0, r_u)
    torch.testing.assert_close(
        out.float(), torch.nn.functional.linear(xn.float(), w.float(), _f(b)), **TOL
    )
    # Same roundings as the two launches it replaces: equal almost everywhere.
    assert (out == unf).float().mean() > 0.99


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_gate_up_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    from voltserve.kernels.activation import silu_and_mul_ref
    from voltserve.kernels.gemv import gemv_gate_up_cuda, gemv_gate_up_prenorm_cuda

    x, residual, norm_w, ro = _norm_inputs(M, K)
    w, b = _weight(2 * inter, K, with_bias)
    out = torch.full((M, inter), NAN, device=DEV, dtype=torch.float16)
    gemv_gate_up_prenorm_cuda(x, residual, norm_w, eps, w, b, residual_out=ro, out=out)
    xn, _ = _xn_ref(x, residual, norm_w, eps)
    xn_u, r_u = _unfused(x, residual, norm_w, eps)
    unf = gemv_gate_up_cuda(xn_u, w, b)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    _check_residual(ro, x, residual, r_u)
    y = torch.nn.functional.linear(xn.float(), w.float(), _f(b)).half()  # as the linear stores it
    torch.testing.assert_close(out.float(), silu_and_mul_ref(y).float(), **TOL)
    assert (out == unf).float().mean() > 0.99


def _rope_inputs(M, n_kv, D, blocks=64, bs=16):
    from voltserve.kernels.rotary import build_cos_sin_cache

    pos = torch.randint(0, 4096, (M,), device=DEV)
    slots = torch.randperm(blocks * bs, device=DEV)[:M]
    if M > 1:
        slots[1] = -1  # padding row
    cache = build_cos_sin_cache(D, 4096, 500000.0).to(DEV)
    kc = torch.full((blocks, n_kv, bs, D), NAN, device=DEV, dtype=torch.float16)
    return pos, cache, kc, kc.clone(), slots


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_qkv_rope_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    from voltserve.kernels.gemv_qkv_rope import (
        gemv_qkv_rope_cuda,
        gemv_qkv_rope_prenorm_cuda,
        gemv_qkv_rope_ref,
    )

    x, residual, norm_w, ro = _norm_inputs(M, K)
    w, b = _weight((n_q + 2 * n_kv) * D, K, with_bias)
    pos, cache, kc, vc, slots = _rope_inputs(M, n_kv, D)
    out = torch.full((M, w.shape[0]), NAN, device=DEV, dtype=torch.float16)
    rope = (pos, cache, kc, vc, slots, n_q, n_kv)
    gemv_qkv_rope_prenorm_cuda(x, residual, norm_w, eps, w, b, *rope, residual_out=ro, out=out)
    # The reference in fp32 after the fp16 norm, on its own caches.
    xn, _ = _xn_ref(x, residual, norm_w, eps)
    kr, vr = kc.float(), vc.float()
    ref = gemv_qkv_rope_ref(xn.float(), w.float(), _f(b), pos, cache, kr, vr, slots, n_q, n_kv)
    # The launches it replaces, on their own caches.
    xn_u, r_u = _unfused(x, residual, norm_w, eps)
    ku, vu = kc.clone().fill_(NAN), vc.clone().fill_(NAN)
    unf = gemv_qkv_rope_cuda(xn_u, w, b, pos, cache, ku, vu, slots, n_q, n_kv)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    _check_residual(ro, x, residual, r_u)
    torch.testing.assert_close(out.float(), ref, **ROPE_TOL)
    torch.testing.assert_close(kc.float(), kr, **ROPE_TOL)
    torch.testing.assert_close(vc.float(), vr, **ROPE_TOL)
    assert (out == unf).float().mean() > 0.99
    torch.testing.assert_close(kc, ku, **ROPE_TOL)
    torch.testing.assert_close(vc, vu, **ROPE_TOL)
    # Exactly the non-padding rows' slots were written (one row per KV head each).
    assert int((~torch.isnan(kc)).any(-1).sum()) == int((slots >= 0).sum()) * n_kv


def test_layer_in_cuda_graph():
    """A Llama-3-8B decoder layer's two fused launches captured in one graph (qkv_rope with the
    input norm; gate_up with the post-attention norm, fed the first one's residual_out), then
    replayed on fresh inputs."""
    from voltserve.kernels.gemv import gemv_gate_up_prenorm_cuda, gemv_gate_up_prenorm_ref
    from voltserve.kernels.gemv_qkv_rope import (
        gemv_qkv_rope_prenorm_cuda,
        gemv_qkv_rope_prenorm_ref,
    )

    K, n_q, n_kv, D, inter, _, eps = SHAPES[0]
    x, residual, nw1, r1 = _norm_inputs(1, K)
    attn, _, nw2, r2 = _norm_inputs(1, K)
    wqkv, _ = _weight((n_q + 2 * n_kv) * D, K, False)
    wgu, _ = _weight(2 * inter, K, False)
    pos, cache, kc, vc, slots = _rope_inputs(1, n_kv, D)
    kc.zero_()
    vc.zero_()
    qkv = torch.empty(1, wqkv.shape[0], device=DEV, dtype=torch.float16)
    h = torch.empty(1, inter, device=DEV, dtype=torch.float16)
    rope = (pos, cache, kc, vc, slots, n_q, n_kv)

    def layer():
        gemv_qkv_rope_prenorm_cuda(
            x, residual, nw1, eps, wqkv, None, *rope, residual_out=r1, out=qkv
        )
        gemv_gate_up_prenorm_cuda(attn, r1, nw2, eps, wgu, None, residual_out=r2, out=h)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer()
    for _ in range(3):
        for t in (x, residual, attn):
            t.copy_(torch.randn_like(t))
        pos.random_(0, 4096)
        slots.copy_(torch.randint(0, kc.shape[0] * 16, (1,), device=DEV))
        for t in (qkv, h, r1, r2):
            t.fill_(NAN)
        g.replay()
        kr, vr, r1r, r2r = kc.clone(), vc.clone(), torch.empty_like(r1), torch.empty_like(r2)
        ref_qkv = gemv_qkv_rope_prenorm_ref(
            x,
            residual,
            nw1,
            eps,
            wqkv,
            None,
            pos,
            cache,
            kr,
            vr,
            slots,
            n_q,
            n_kv,
            residual_out=r1r,
        )
        ref_h = gemv_gate_up_prenorm_ref(attn, r1r, nw2, eps, wgu, None, residual_out=r2r)
        torch.cuda.synchronize()
        assert torch.equal(r1, r1r) and torch.equal(r2, r2r)
        torch.testing.assert_close(qkv, ref_qkv, **ROPE_TOL)
        torch.testing.assert_close(kc, kr, **ROPE_TOL)
        torch.testing.assert_close(vc, vr, **ROPE_TOL)
        torch.testing.assert_close(h, ref_h, **ROPE_TOL)


def test_shared_memory_bound():
    """K = 8192 at M = 2 (32 KiB of shared rows) runs the kernel; K = 12288 at M = 2 (48 KiB +
    the scratch) is refused and falls back to the reference, with the same result."""
    from voltserve.kernels.gemv import gemv_prenorm_cuda, gemv_prenorm_ref, supports_prenorm

    for K, fused in ((8192, True), (12288, False)):
        x, residual, norm_w, ro = _norm_inputs(2, K)
        w, _ = _weight(1000, K, False)
        assert supports_prenorm(x, residual, norm_w, ro) == fused
        out = torch.full((2, 1000), NAN, device=DEV, dtype=torch.float16)
        gemv_prenorm_cuda(x, residual, norm_w, 1e-5, w, residual_out=ro, out=out)
        rr = torch.empty_like(ro)
        ref = gemv_prenorm_ref(x, residual, norm_w, 1e-5, w, residual_out=rr)
        torch.cuda.synchronize()
        assert torch.equal(ro, rr) and not torch.isnan(out).any()
        torch.testing.assert_close(out, ref, **TOL)
