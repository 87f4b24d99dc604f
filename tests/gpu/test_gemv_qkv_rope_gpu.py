"""The qkv GEMV with rotary and the KV-cache write fused (kernels/linear/gemv_qkv_rope.py) on a real
GPU at Llama-3-8B and Qwen2.5-0.5B shapes: against its reference and against the two launches it
replaces (gemv_cuda, then rotary_and_cache_cuda), with NaN-poisoned outputs, padding slots, and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# (K, n_q, n_kv, head_dim, bias): Llama-3-8B (4096 = two full steps), Qwen2.5-0.5B (896, bias)
SHAPES = [(4096, 32, 8, 128, False), (896, 14, 2, 64, True)]


def _inputs(M, K, n_q, n_kv, D, with_bias, blocks=64, bs=16):
    from voltserve.kernels.attention.rotary import build_cos_sin_cache

    N = (n_q + 2 * n_kv) * D
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.02)
    b = torch.randn(N, device=DEV, dtype=torch.float16) if with_bias else None
    pos = torch.randint(0, 4096, (M,), device=DEV)
    slots = torch.randperm(blocks * bs, device=DEV)[:M]
    if M > 2:
        slots[1] = -1  # padding row
    cache = build_cos_sin_cache(D, 4096, 500000.0).to(DEV)
    kc = torch.full((blocks, n_kv, bs, D), float("nan"), device=DEV, dtype=torch.float16)
    return x, w, b, pos, cache, kc, kc.clone(), slots


@pytest.mark.parametrize("K,n_q,n_kv,D,with_bias", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 8])
def test_qkv_rope_matches_reference_and_unfused(K, n_q, n_kv, D, with_bias, M):
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_cuda
    from voltserve.kernels.linear.gemv import gemv_cuda
    from voltserve.kernels.linear.gemv_qkv_rope import (
        gemv_qkv_rope_cuda,
        gemv_qkv_rope_ref,
        supports_qkv_rope,
    )

    x, w, b, pos, cache, kc, vc, slots = _inputs(M, K, n_q, n_kv, D, with_bias)
    args = (pos, cache, kc, vc, slots, n_q, n_kv)
    assert supports_qkv_rope(x, w, *args)
    out = torch.full((M, w.shape[0]), float("nan"), device=DEV, dtype=torch.float16)
    gemv_qkv_rope_cuda(x, w, b, *args, out=out)
    # The reference in fp32 (product, rotary, cache write) on its own caches.
    kr, vr = kc.float(), vc.float()
    ref = gemv_qkv_rope_ref(
        x.float(), w.float(), None if b is None else b.float(), pos, cache, kr, vr, slots, n_q, n_kv
    )
    # The two launches it replaces, on their own caches.
    ku, vu = kc.clone(), vc.clone()
    unf = gemv_cuda(x, w, b)
    q, k, v = unf.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    rotary_and_cache_cuda(pos, q, k, v, D, cache, True, ku, vu, slots)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    tol = dict(atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(kc.float(), kr, **tol)
    torch.testing.assert_close(vc.float(), vr, **tol)
    # Same roundings as the unfused pair (summation order aside): equal almost everywhere.
    assert (out == unf).float().mean() > 0.99
    torch.testing.assert_close(kc, ku, equal_nan=True, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(vc, vu, equal_nan=True, atol=2e-2, rtol=2e-2)
    # Exactly the non-padding rows' slots were written (one row per KV head each).
    assert int((~torch.isnan(kc)).any(-1).sum()) == int((slots >= 0).sum()) * n_kv


def test_qkv_rope_in_cuda_graph():
    from voltserve.kernels.linear.gemv_qkv_rope import gemv_qkv_rope_cuda, gemv_qkv_rope_ref

    K, n_q, n_kv, D = 4096, 32, 8, 128
    x, w, b, pos, cache, kc, vc, slots = _inputs(1, K, n_q, n_kv, D, False)
    kc.zero_()
    vc.zero_()
    out = torch.empty(1, w.shape[0], device=DEV, dtype=torch.float16)
    args = (pos, cache, kc, vc, slots, n_q, n_kv)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_qkv_rope_cuda(x, w, b, *args, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv_qkv_rope_cuda(x, w, b, *args, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        pos.random_(0, 4096)
        slots.copy_(torch.randint(0, kc.shape[0] * 16, (1,), device=DEV))
        out.fill_(float("nan"))
        g.replay()
        kr, vr = kc.clone(), vc.clone()
        ref = gemv_qkv_rope_ref(x, w, b, pos, cache, kr, vr, slots, n_q, n_kv)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kc, kr, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(vc, vr, atol=2e-2, rtol=2e-2)
