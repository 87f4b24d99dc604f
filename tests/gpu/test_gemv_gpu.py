"""The decode GEMV kernel (kernels/linear/gemv.py) on a real GPU at Llama-3-8B (and Qwen2.5-0.5B)
shapes, against an fp32 reference and against torch's fp16 linear (cuBLAS); inside a CUDA graph
too."""

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
    from voltserve.kernels.linear.gemv import gemv_cuda, supports

    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.02)
    assert supports(x, w)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float16)
    gemv_cuda(x, w, out=out)
    torch.cuda.synchronize()
    _check(out, x, w, None)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_bias_and_odd_m(M):
    from voltserve.kernels.linear.gemv import gemv_cuda

    K, N = 896, 1152  # Qwen2 qkv (with bias)
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.05)
    b = torch.randn(N, device=DEV, dtype=torch.float16)
    out = gemv_cuda(x, w, b)
    torch.cuda.synchronize()
    _check(out, x, w, b)


def test_gemv_in_cuda_graph():
    from voltserve.kernels.linear.gemv import gemv_cuda

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


# ---- gemv_gate_up: silu_and_mul fused into the gate_up projection's output -------------------

# (K, 2I): Llama-3-8B gate_up (4096 = 4 full 1024-element steps) and Qwen2.5-0.5B gate_up
# (896: a guarded partial step).
GATE_UP_SHAPES = [(4096, 28672), (896, 9728)]


@pytest.mark.parametrize("K,N", GATE_UP_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
def test_gemv_gate_up_matches_linear_then_silu(K, N, M):
    from voltserve.kernels.elementwise.activation import silu_and_mul_cuda, silu_and_mul_ref
    from voltserve.kernels.linear.gemv import gemv_cuda, gemv_gate_up_cuda, supports_gate_up

    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.empty(N, K, device=DEV, dtype=torch.float16).normal_(0, 0.04)  # gate ~ N(0, 2.5)
    bias = torch.randn(N, device=DEV, dtype=torch.float16) if M == 3 else None
    assert supports_gate_up(x, w)
    out = torch.full((M, N // 2), float("nan"), device=DEV, dtype=torch.float16)
    gemv_gate_up_cuda(x, w, bias, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    # Against the fp32 product rounded to fp16 (what the linear stores), then silu_and_mul.
    y16 = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    ref = silu_and_mul_ref(y16.half())
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    # Against the two launches it replaces (same roundings, summation order aside).
    unfused = silu_and_mul_cuda(gemv_cuda(x, w, bias))
    torch.testing.assert_close(out, unfused, atol=2e-2, rtol=2e-2)
    close = (out.float() - unfused.float()).abs() <= 1e-3 + 2**-10 * unfused.float().abs()
    assert close.float().mean() > 0.99, "more than 1% of outputs off by more than an ulp"


def test_gemv_gate_up_fp32_and_graph():
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref
    from voltserve.kernels.linear.gemv import gemv_gate_up_cuda

    K, N = 896, 9728
    x = torch.randn(2, K, device=DEV)
    w = torch.empty(N, K, device=DEV).normal_(0, 0.04)
    b = torch.randn(N, device=DEV)
    out = gemv_gate_up_cuda(x, w, b)
    torch.cuda.synchronize()
    ref = silu_and_mul_ref(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)

    x16, w16 = x[:1].half(), w.half()
    out16 = torch.empty(1, N // 2, device=DEV, dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_gate_up_cuda(x16, w16, out=out16)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv_gate_up_cuda(x16, w16, out=out16)
    for _ in range(2):
        x16.copy_(torch.randn_like(x16))
        out16.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        y = torch.nn.functional.linear(x16.float(), w16.float()).half()
        torch.testing.assert_close(out16, silu_and_mul_ref(y), atol=2e-2, rtol=2e-2)
