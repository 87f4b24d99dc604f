"""The decode GEMV kernel (kernels/gemv.py) on a real GPU at Llama-3-8B (and Qwen2.5-0.5B) shapes,
against an fp32 reference and against torch's fp16 linear (cuBLAS); inside a CUDA graph too."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# (K, N): Llama-3-8B qkv, o_proj, gate_up, lm_head, down_proj; Qwen2.5-0.5B qkv (K not a
# multiple of 256: the guarded step) and down_proj.
SHAPES = [
    (4096, 6144),
    (4096, 4096),
    (4096, 28672),
    (4096, 128256),
    (14336, 4096),
    (896, 1152),
    (4864, 896),
]


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    ref32 = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    # fp32 accumulation, one rounding to fp16 (half an ulp, relative 2^-11) plus the summation
    # order: well inside 1e-2 at |y| ~ 1.
    torch.testing.assert_close(out.float(), ref32, atol=1e-2, rtol=1e-2)
    err = (out.float() - ref32).abs().max().item()
    ref16 = torch.nn.functional.linear(x, w, bias).float()
    err16 = (ref16 - ref32).abs().max().item()
    # No worse than cuBLAS's own fp16 result by more than an ulp at the output's scale.
    scale = ref32.abs().max().item()
    assert err <= err16 + scale * 2**-10 + 1e-4, (err, err16, scale)


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_gemv_matches_reference(K, N, M):
    from voltserve.kernels.gemv import gemv_cuda, supports

    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.02)
    assert supports(x, w)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float16)
    gemv_cuda(x, w, out=out)
    torch.cuda.synchronize()
    _check(out, x, w, None)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_bias_and_odd_m(M):
    from voltserve.kernels.gemv import gemv_cuda

    K, N = 896, 1152  # Qwen2 qkv (with bias)
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.05)
    b = torch.randn(N, device=DEV, dtype=torch.float16)
    out = gemv_cuda(x, w, b)
    torch.cuda.synchronize()
    _check(out, x, w, b)


def test_gemv_in_cuda_graph():
    from voltserve.kernels.gemv import gemv_cuda

    K, N = 4096, 6144
    x = torch.randn(1, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.02)
    out = torch.empty(1, N, device=DEV, dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_cuda(x, w, out=out)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv_cuda(x, w, out=out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))  # fresh input each replay
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(out, x, w, None)
