"""The decode GEMVs with the residual add and RMSNorm folded in (kernels/gemv_norm.py) against
their references in the CUDA simulator (fresh random inputs, NaN-poisoned outputs, bias on and
off, fp16 and fp32), and the fused-norm decode of a model on the CPU against the unfused one."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels import gemv, gemv_norm
from voltserve.kernels.gemv_qkv_rope import gemv_qkv_rope_ref
from voltserve.kernels.numba_common import SIM, launch
from voltserve.kernels.rmsnorm import rms_norm_ref
from voltserve.kernels.rotary import build_cos_sin_cache

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
TOL16 = dict(atol=8e-3, rtol=8e-3)
TOL32 = dict(atol=1e-4, rtol=1e-4)


def _np(*ts):
    return tuple(t.numpy() for t in ts)


def _spread_ss(x: torch.Tensor) -> torch.Tensor:
    """x's row sums of squares split over the SS_SLOTS slots in random shares (as the residual
    epilogue leaves them: a kernel that reads only some slots gets a wrong rms)."""
    share = torch.rand(x.shape[0], gemv.SS_SLOTS)
    share /= share.sum(-1, keepdim=True)
    return (share * x.float().square().sum(-1, keepdim=True)).contiguous()


def test_rms_norm_from_ss_ref_equals_rms_norm_ref():
    x = (torch.randn(3, 40) * 3).half()
    nw = (torch.rand(40) + 0.5).half()
    got = gemv_norm.rms_norm_from_ss_ref(x, nw, 1e-5, _spread_ss(x))
    torch.testing.assert_close(got, rms_norm_ref(x, nw, 1e-5), atol=2e-3, rtol=2e-3)


@sim_only
@pytest.mark.parametrize(
    "dtype,M,K,with_bias", [(torch.float16, 1, 264, True), (torch.float32, 2, 24, False)]
)
def test_gemv_residual_adds_into_the_residual(dtype, M, K, with_bias):
    N = 3
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    bias = torch.randn(N, dtype=dtype) if with_bias else None
    residual = torch.randn(M, N).to(dtype)
    # Sums of squares start from what is there (the kernel adds): fresh random values.
    ss = torch.rand(M, gemv.SS_SLOTS)
    ss0, ss_want = ss.clone(), ss.clone()
    want = gemv_norm.gemv_residual_ref(x, w, bias, residual.clone(), ss_want)
    b = bias if bias is not None else w[0]
    launch(
        gemv.gemv_kernel(M, gemv.PLAIN, res=True),
        N,  # one warp (here: one block) per row
        32,
        (*_np(x, w, b, residual), with_bias, ss.numpy()),
    )
    tol = TOL16 if dtype == torch.float16 else TOL32
    torch.testing.assert_close(residual.float(), want.float(), **tol)
    assert not torch.equal(residual, want - want)  # not left at zero
    # Row totals gained the new residual's squares (the spread over slots is the kernel's own).
    gained = ss.sum(-1) - ss0.sum(-1)
    torch.testing.assert_close(gained, residual.float().square().sum(-1), **TOL32)
    torch.testing.assert_close(ss.sum(-1), ss_want.sum(-1), **TOL32)


@sim_only
@pytest.mark.parametrize(
    "dtype,M,K,with_bias", [(torch.float16, 1, 264, False), (torch.float32, 2, 24, True)]
)
def test_gemv_gate_up_norm_matches_norm_then_gate_up(dtype, M, K, with_bias):
    inter = 2
    x = (torch.randn(M, K) * 3).to(dtype)  # a residual stream far from unit rms
    w = (torch.randn(2 * inter, K) * 2 / K**0.5).to(dtype)
    bias = torch.randn(2 * inter, dtype=dtype) if with_bias else None
    nw = (torch.rand(K) + 0.5).to(dtype)
    eps = 1e-5
    out = torch.full((M, inter), float("nan"), dtype=dtype)
    b = bias if bias is not None else w[0]
    launch(
        gemv.gemv_kernel(M, gemv.GATE_UP, norm=True),
        inter,
        32,
        (*_np(x, w, b, out), with_bias, nw.numpy(), eps, _spread_ss(x).numpy()),
    )
    assert not torch.isnan(out).any()
    # Against the unfused chain: RMSNorm (its own sum of squares), then gate_up.
    xn = rms_norm_ref(x.float(), nw.float(), eps)
    want = gemv.gemv_gate_up_ref(xn, w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), want, **(TOL16 if dtype == torch.float16 else TOL32))
    # The norm was applied: without it the product differs.
    plain = gemv.gemv_gate_up_ref(x.float(), w.float(), None if bias is None else bias.float())
    assert not torch.allclose(out.float(), plain, **TOL16)


@sim_only
def test_gemv_qkv_rope_norm_matches_norm_then_qkv_rope():
    dtype, M, K = torch.float16, 2, 24
    n_q, n_kv, D, bs = 2, 1, 16, 4
    N = (n_q + 2 * n_kv) * D
    x = (torch.randn(M, K) * 3).to(dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    nw = (torch.rand(K) + 0.5).to(dtype)
    positions = torch.randint(0, 64, (M,), dtype=torch.int64)
    slots = torch.tensor([5, -1], dtype=torch.int64)
    cache = build_cos_sin_cache(D, 64, 10000.0)
    kc = torch.randn(3, n_kv, bs, D).to(dtype)
    vc = torch.randn_like(kc)
    kr, vr = kc.float(), vc.float()
    want = gemv_qkv_rope_ref(
        rms_norm_ref(x.float(), nw.float(), 1e-6),
        w.float(),
        None,
        positions,
        cache,
        kr,
        vr,
        slots,
        n_q,
        n_kv,
    )
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch(
        gemv.gemv_kernel(M, gemv.QKV_ROPE, norm=True),
        N // 2,
        32,
        (
            *_np(x, w, w[0], out),
            False,
            *_np(positions, cache, kc, vc, slots),
            n_q,
            n_kv,
            nw.numpy(),
            1e-6,
            _spread_ss(x).numpy(),
        ),
    )
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), want, **TOL16)
    torch.testing.assert_close(kc.float(), kr, **TOL16)
    torch.testing.assert_close(vc.float(), vr, **TOL16)


def test_res_epilogue_only_for_plain():
    with pytest.raises(ValueError, match="plain kind only"):
        gemv._source(1, *gemv.tile_for(1, gemv.GATE_UP), gemv.GATE_UP, res=True)
    with pytest.raises(ValueError, match="not both"):
        gemv._source(1, *gemv.tile_for(1), gemv.PLAIN, norm=True, res=True)


def test_fused_norm_decode_equals_unfused_on_cpu():
    """ops.fuse_norms: a decode step of <= 2 rows runs every layer on the fused-norm ops (their
    references on the CPU), with no norm launch but the final one, and its logits equal the
    unfused step's."""
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.loader import load_model

    from tests.checkpoints import checkpoint
    from tests.engine.test_linear_plan import _decode_logits, _spy

    model = load_model(checkpoint("llama"), torch.float32, torch.device("cpu")).model
    n = model.arch.num_layers
    from voltserve.services.executor.linear_plan import LinearPlan

    ops = KernelDispatch("cpu", torch.float32)
    ops.linear_plan = LinearPlan.rule()  # what a GPU runner has: gate_up with SiLU at <= 2 rows
    want = _decode_logits(model, ops, 2, 5, seed=4)
    ops.fuse_norms = True
    names = (
        "gemv_residual",
        "gemv_gate_up_norm",
        "gemv_qkv_rope_norm",
        "rms_norm",
        "fused_add_rms_norm",
    )
    calls = _spy(ops, names)
    got = _decode_logits(model, ops, 2, 5, seed=4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # prefill (10 rows): the unfused layer (1 rms_norm, 2n - 1 fused adds + the final one);
    # decode: 2n residual GEMVs, n gate_up norm GEMVs, n - 1 qkv norm GEMVs (the first layer's
    # input rms_norm runs alone before its plain qkv GEMV), and the final rms_norm.
    counts = {k: calls.count(k) for k in names}
    assert counts == {
        "gemv_residual": 2 * n,
        "gemv_gate_up_norm": n,
        "gemv_qkv_rope_norm": n - 1,
        "rms_norm": 3,
        "fused_add_rms_norm": 2 * n,
    }, counts
