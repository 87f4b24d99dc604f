"""The decode GEMVs with the residual add and RMSNorm folded in (kernels/gemv_norm.py) on a real
GPU at Llama-3-8B and Qwen2.5-0.5B shapes, against their references (the unfused ops in fp32 and
the unfused kernels in fp16), with NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
H16 = dict(device=DEV, dtype=torch.float16)


def _spread_ss(x: torch.Tensor) -> torch.Tensor:
    """x's row sums of squares split over the slots in random shares (as the residual epilogue
    leaves them: a kernel that reads only some slots gets a wrong rms)."""
    from voltserve.kernels.gemv import SS_SLOTS

    share = torch.rand(x.shape[0], SS_SLOTS, device=DEV)
    share /= share.sum(-1, keepdim=True)
    return (share * x.float().square().sum(-1, keepdim=True)).contiguous()


@pytest.mark.parametrize("K,N", [(4096, 4096), (14336, 4096), (896, 896), (4864, 896)])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_residual(K, N, M):
    from voltserve.kernels.gemv_norm import gemv_residual_cuda

    x = torch.randn(M, K, **H16)
    w = torch.empty(N, K, **H16).normal_(0, 0.02)
    residual = torch.randn(M, N, **H16)
    want32 = residual.float() + torch.nn.functional.linear(x.float(), w.float())
    want16 = residual + torch.nn.functional.linear(x, w)  # the unfused pair (cuBLAS, then add)
    ss = torch.rand(M, 32, device=DEV)  # the kernel adds to what is there
    ss0 = ss.clone()
    got = gemv_residual_cuda(x, w, None, residual, ss)
    torch.cuda.synchronize()
    assert got is residual
    torch.testing.assert_close(residual.float(), want32, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(residual, want16, atol=2e-2, rtol=2e-2)
    gained = (ss - ss0).sum(-1)
    torch.testing.assert_close(gained, residual.float().square().sum(-1), atol=1e-2, rtol=1e-4)


@pytest.mark.parametrize("K,N", [(4096, 28672), (896, 9728)])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_gate_up_norm(K, N, M):
    from voltserve.kernels.activation import silu_and_mul_ref
    from voltserve.kernels.gemv_norm import gemv_gate_up_norm_cuda
    from voltserve.kernels.rmsnorm import rms_norm_cuda

    x = torch.randn(M, K, **H16) * 4  # a residual stream far from unit rms
    w = torch.empty(N, K, **H16).normal_(0, 0.04)
    nw = torch.rand(K, **H16) + 0.5
    got = gemv_gate_up_norm_cuda(x, w, None, nw, 1e-5, _spread_ss(x))
    xn = rms_norm_cuda(x, nw, 1e-5)  # the unfused kernel's normalised rows
    want = silu_and_mul_ref(torch.nn.functional.linear(xn.float(), w.float()).half())
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("K,n_q,n_kv,D", [(4096, 32, 8, 128), (896, 14, 2, 64)])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_qkv_rope_norm(K, n_q, n_kv, D, M):
    from voltserve.kernels.gemv_norm import gemv_qkv_rope_norm_cuda, gemv_qkv_rope_norm_ref
    from voltserve.kernels.rotary import build_cos_sin_cache

    N = (n_q + 2 * n_kv) * D
    x = torch.randn(M, K, **H16) * 4
    w = torch.empty(N, K, **H16).normal_(0, 0.02)
    nw = torch.rand(K, **H16) + 0.5
    pos = torch.randint(0, 4096, (M,), device=DEV)
    slots = torch.randperm(64 * 16, device=DEV)[:M]
    cache = build_cos_sin_cache(D, 4096, 500000.0).to(DEV)
    kc = torch.full((64, n_kv, 16, D), float("nan"), **H16)
    vc = kc.clone()
    kr, vr = kc.float(), vc.float()
    ss = _spread_ss(x)
    got = gemv_qkv_rope_norm_cuda(x, w, None, pos, cache, kc, vc, slots, n_q, n_kv, nw, 1e-5, ss)
    want = gemv_qkv_rope_norm_ref(
        x.float(), w.float(), None, pos, cache, kr, vr, slots, n_q, n_kv, nw.float(), 1e-5, ss
    )
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    tol = dict(atol=3e-2, rtol=3e-2, equal_nan=True)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(kc.float(), kr, **tol)
    torch.testing.assert_close(vc.float(), vr, **tol)
