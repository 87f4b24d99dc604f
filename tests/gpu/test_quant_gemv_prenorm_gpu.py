"""The pre-norm quantized GEMVs (kernels/quant_gemv.py: gemv.py's residual add + RMSNorm prologue
in the plain, gate_up and qkv_rope kernels of group-quantized weights) on a real GPU at
Llama-3-8B (int4 g128: qkv 6144 with rotary and the KV write, gate_up 2 x 14336, K = 4096) and
Qwen2.5-0.5B shapes (K = 896, qkv bias), M = 1 and 2: against the composed references (in fp32
after the storage-dtype norm) and against the launches they replace (fused_add_rms_norm_cuda,
then the quantized GEMV), NaN-poisoned outputs, residual_out and caches; int8 and int4 g32 /
g16; wider blocks (PRENORM_WARPS); the quant_linear entry points (folded, and their fallbacks:
act-order weights, 3 rows); one CUDA-graph capture of a layer's two fused launches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
NAN = float("nan")
# (K, n_q, n_kv, head_dim, intermediate, qkv bias, eps): Llama-3-8B, Qwen2.5-0.5B.
LLAMA = (4096, 32, 8, 128, 14336, False, 1e-5)
QWEN = (896, 14, 2, 64, 4864, True, 1e-6)
SHAPES = [LLAMA, QWEN]
# Half2 runs (~4e-4 of max |y|), fp32 sums in another order, one or two fp16 roundings at
# |y| ~ 1, and now and then an element of xn an ulp apart (1/rms summed in another order).
TOL = dict(atol=1e-2, rtol=1e-2)
ROPE_TOL = dict(atol=2e-2, rtol=2e-2, equal_nan=True)


def _weight(N: int, K: int, bits: int = 4, g: int = 128, perm: bool = False):
    from voltserve.kernels.quant_pack import pack_group_quant

    codes = torch.randint(0, 2**bits, (N, K), device=DEV, dtype=torch.uint8)
    G = K // g
    s = (torch.rand(N, G, device=DEV) + 0.5) * (0.04 / 2**bits)  # weights ~ +-0.02
    o = -s * 2 ** (bits - 1) + torch.randn(N, G, device=DEV) * 0.002
    p = torch.randperm(K, device=DEV) if perm else None
    return pack_group_quant(codes, s, o, bits, g, torch.float16, perm=p)


def _rows(M: int, K: int):
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    residual = (torch.randn(M, K, device=DEV) * 4).to(torch.float16)
    norm_w = (1 + 0.1 * torch.randn(K, device=DEV)).to(torch.float16)
    return x, residual, norm_w, torch.full_like(x, NAN)


def _bias(N: int, on: bool):
    return torch.randn(N, device=DEV, dtype=torch.float16) if on else None


def _f(t):
    return None if t is None else t.float()


def _xn_ref(x, residual, norm_w, eps):
    from voltserve.kernels.gemv import prenorm_ref

    r = torch.empty_like(x)
    return prenorm_ref(x, residual, norm_w, eps, r), r


def _unfused(x, residual, norm_w, eps):
    """What the fused launch replaces: fused_add_rms_norm_cuda on copies -> (xn, residual)."""
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_cuda

    xn, r = x.clone(), residual.clone()
    fused_add_rms_norm_cuda(xn, r, norm_w, eps)
    return xn, r


def _linear32(xn, w, b):
    from voltserve.kernels.quant_pack import dequantize

    xp = xn if w.perm is None else xn[:, w.perm]
    return F.linear(xp.float(), dequantize(w, torch.float32), _f(b))


def _rope_inputs(M, n_kv, D, blocks=64, bs=16):
    from voltserve.kernels.rotary import build_cos_sin_cache

    pos = torch.randint(0, 4096, (M,), device=DEV)
    slots = torch.randperm(blocks * bs, device=DEV)[:M]
    if M > 1:
        slots[1] = -1  # padding row
    cache = build_cos_sin_cache(D, 4096, 500000.0).to(DEV)
    kc = torch.full((blocks, n_kv, bs, D), NAN, device=DEV, dtype=torch.float16)
    return pos, cache, kc, kc.clone(), slots


def _plain(M, K, N, with_bias, eps, bits=4, g=128):
    from voltserve.kernels import quant_gemv

    x, residual, norm_w, ro = _rows(M, K)
    w, b = _weight(N, K, bits, g), _bias(N, with_bias)
    assert quant_gemv.supports_prenorm(x, w, residual, norm_w, ro)
    x0, r0 = x.clone(), residual.clone()
    out = torch.full((M, N), NAN, device=DEV, dtype=torch.float16)
    got = quant_gemv.quant_gemv_prenorm_cuda(
        x, residual, norm_w, eps, w, b, residual_out=ro, out=out
    )
    xn, r_ref = _xn_ref(x0, r0, norm_w, eps)
    xn_u, r_u = _unfused(x0, r0, norm_w, eps)
    unf = quant_gemv.quant_gemv_cuda(xn_u, w, b)
    torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    assert torch.equal(ro, r_ref) and torch.equal(ro, r_u)  # residual + x in fp16, bit for bit
    torch.testing.assert_close(out.float(), _linear32(xn, w, b), **TOL)
    # The same dot product as the GEMV it replaces, on the same xn up to rare ulps.
    assert (out == unf).float().mean() > 0.99


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_plain_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    _plain(M, K, (n_q + 2 * n_kv) * D, with_bias, eps)


@pytest.mark.parametrize("bits,g", [(8, 128), (4, 32), (4, 16)])
@pytest.mark.parametrize("M", [1, 2])
def test_plain_prenorm_other_codes(bits, g, M):
    """int8 and int4 g16 (factored form), int4 g32 (half2), Llama's o_proj shape."""
    _plain(M, 4096, 4096, False, 1e-5, bits, g)


@pytest.mark.parametrize("warps", [8, 16])
@pytest.mark.parametrize("M", [1, 2])
def test_plain_prenorm_wide_blocks(monkeypatch, warps, M):
    from voltserve.kernels import quant_gemv

    monkeypatch.setattr(quant_gemv, "PRENORM_WARPS", warps)
    _plain(M, 4096, 6144, False, 1e-5)


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_gate_up_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    from voltserve.kernels.activation import silu_and_mul_ref
    from voltserve.kernels.quant_gemv import (
        quant_gemv_gate_up_cuda,
        quant_gemv_gate_up_prenorm_cuda,
    )

    x, residual, norm_w, ro = _rows(M, K)
    w = _weight(2 * inter, K)
    out = torch.full((M, inter), NAN, device=DEV, dtype=torch.float16)
    quant_gemv_gate_up_prenorm_cuda(x, residual, norm_w, eps, w, None, residual_out=ro, out=out)
    xn, r_ref = _xn_ref(x, residual, norm_w, eps)
    xn_u, r_u = _unfused(x, residual, norm_w, eps)
    unf = quant_gemv_gate_up_cuda(xn_u, w)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    assert torch.equal(ro, r_ref) and torch.equal(ro, r_u)
    y = _linear32(xn, w, None).half()  # as the linear stores it
    torch.testing.assert_close(out.float(), silu_and_mul_ref(y).float(), **TOL)
    assert (out == unf).float().mean() > 0.99


@pytest.mark.parametrize("K,n_q,n_kv,D,inter,with_bias,eps", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_qkv_rope_prenorm(K, n_q, n_kv, D, inter, with_bias, eps, M):
    from voltserve.kernels.quant_gemv import (
        quant_qkv_rope_cuda,
        quant_qkv_rope_prenorm_cuda,
        quant_qkv_rope_ref,
    )

    x, residual, norm_w, ro = _rows(M, K)
    N = (n_q + 2 * n_kv) * D
    w, b = _weight(N, K), _bias(N, with_bias)
    pos, cache, kc, vc, slots = _rope_inputs(M, n_kv, D)
    rope = (pos, cache, kc, vc, slots, n_q, n_kv)
    out = torch.full((M, N), NAN, device=DEV, dtype=torch.float16)
    quant_qkv_rope_prenorm_cuda(x, residual, norm_w, eps, w, b, *rope, residual_out=ro, out=out)
    xn, r_ref = _xn_ref(x, residual, norm_w, eps)
    kr, vr = kc.float(), vc.float()
    ref = quant_qkv_rope_ref(xn.float(), w, _f(b), pos, cache, kr, vr, slots, n_q, n_kv)
    xn_u, r_u = _unfused(x, residual, norm_w, eps)
    ku, vu = kc.clone().fill_(NAN), vc.clone().fill_(NAN)
    unf = quant_qkv_rope_cuda(xn_u, w, b, pos, cache, ku, vu, slots, n_q, n_kv)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    assert torch.equal(ro, r_ref) and torch.equal(ro, r_u)
    torch.testing.assert_close(out.float(), ref.float(), **ROPE_TOL)
    torch.testing.assert_close(kc.float(), kr, **ROPE_TOL)
    torch.testing.assert_close(vc.float(), vr, **ROPE_TOL)
    assert (out == unf).float().mean() > 0.99
    torch.testing.assert_close(kc, ku, **ROPE_TOL)
    torch.testing.assert_close(vc, vu, **ROPE_TOL)
    # Exactly the non-padding rows' slots were written (one row per KV head each).
    assert int((~torch.isnan(kc)).any(-1).sum()) == int((slots >= 0).sum()) * n_kv


def _ops():
    from voltserve.kernels.dispatch import KernelDispatch

    o = KernelDispatch(DEV, torch.float16, force_ref=False)
    assert o.impl["quant_linear"] == "cuda"
    return o


@pytest.mark.parametrize("M,perm", [(1, False), (2, True), (3, False)])
def test_entry_points_fold_or_fall_back(M, perm):
    """quant_linear's _prenorm entry points: one launch where prenorm_folds (1-2 rows, no
    permutation), else the norm op and the plain entry point; the same meaning either way."""
    from voltserve.kernels import quant_linear as ql

    ops = _ops()
    K, eps = 4096, 1e-5
    x, residual, norm_w, ro = _rows(M, K)
    w = _weight(6144, K, perm=perm)
    assert ql.prenorm_folds(x, w, ops) == (M <= 2 and not perm)
    out = torch.full((M, 6144), NAN, device=DEV, dtype=torch.float16)
    ql.quant_linear_prenorm(x, residual, norm_w, eps, w, None, ops, residual_out=ro, out=out)
    xn, r_ref = _xn_ref(x, residual, norm_w, eps)
    wg = _weight(2 * 14336, K)
    ro2 = torch.full_like(ro, NAN)
    h = ql.quant_gate_up_silu_prenorm(x, residual, norm_w, eps, wg, None, ops, residual_out=ro2)
    torch.cuda.synchronize()
    assert torch.equal(ro, r_ref) and torch.equal(ro2, r_ref)
    assert not torch.isnan(out).any() and not torch.isnan(h).any()
    torch.testing.assert_close(out.float(), _linear32(xn, w, None), **TOL)
    from voltserve.kernels.activation import silu_and_mul_ref

    ref_h = silu_and_mul_ref(_linear32(xn, wg, None).half()).float()
    torch.testing.assert_close(h.float(), ref_h, **TOL)


def test_layer_in_cuda_graph():
    """A Llama-3-8B int4 decoder layer's two fused launches through the quant_linear entry
    points, captured in one graph (qkv_rope with the input norm; gate_up with the
    post-attention norm, fed the first one's residual_out), replayed on fresh inputs."""
    from voltserve.kernels import quant_linear as ql

    ops = _ops()
    K, n_q, n_kv, D, inter, _, eps = LLAMA
    x, residual, nw1, r1 = _rows(1, K)
    attn, _, nw2, r2 = _rows(1, K)
    wqkv, wgu = _weight((n_q + 2 * n_kv) * D, K), _weight(2 * inter, K)
    pos, cache, kc, vc, slots = _rope_inputs(1, n_kv, D)
    kc.zero_()
    vc.zero_()
    rope = (pos, cache, kc, vc, slots, n_q, n_kv)
    assert ql.prenorm_folds(x, wqkv, ops, "qkv_rope") and ql.prenorm_folds(x, wgu, ops, "gate_up")
    res = {}

    def layer():
        res["qkv"] = ql.quant_qkv_rope_prenorm(
            x, residual, nw1, eps, wqkv, None, ops, *rope, residual_out=r1
        )
        res["h"] = ql.quant_gate_up_silu_prenorm(
            attn, r1, nw2, eps, wgu, None, ops, residual_out=r2
        )

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
        for t in (res["qkv"], res["h"], r1, r2):
            t.fill_(NAN)
        g.replay()
        kr, vr, r1r, r2r = kc.clone(), vc.clone(), torch.empty_like(r1), torch.empty_like(r2)
        ref_qkv = ql.quant_qkv_rope_prenorm_ref(
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
        ref_h = ql.quant_gate_up_prenorm_ref(attn, r1r, nw2, eps, wgu, None, residual_out=r2r)
        torch.cuda.synchronize()
        assert torch.equal(r1, r1r) and torch.equal(r2, r2r)
        torch.testing.assert_close(res["qkv"], ref_qkv, **ROPE_TOL)
        torch.testing.assert_close(kc, kr, **ROPE_TOL)
        torch.testing.assert_close(vc, vr, **ROPE_TOL)
        torch.testing.assert_close(res["h"], ref_h, **ROPE_TOL)


def test_shared_memory_bound():
    """K = 8192 at M = 2 (32 KiB of rows) runs the kernel; K = 12288 at M = 2 (48 KiB) is
    refused and falls back to the reference, with the same meaning."""
    from voltserve.kernels import quant_gemv
    from voltserve.kernels.quant_linear import quant_linear_prenorm_ref

    for K, fused in ((8192, True), (12288, False)):
        x, residual, norm_w, ro = _rows(2, K)
        w = _weight(1000, K)
        assert quant_gemv.supports_prenorm(x, w, residual, norm_w, ro) == fused
        out = torch.full((2, 1000), NAN, device=DEV, dtype=torch.float16)
        quant_gemv.quant_gemv_prenorm_cuda(x, residual, norm_w, 1e-5, w, residual_out=ro, out=out)
        rr = torch.empty_like(ro)
        ref = quant_linear_prenorm_ref(x, residual, norm_w, 1e-5, w, residual_out=rr)
        torch.cuda.synchronize()
        assert torch.equal(ro, rr) and not torch.isnan(out).any()
        torch.testing.assert_close(out, ref, **TOL)
