"""The skinny decode matrix product (kernels/linear/gemv.py) against torch's linear, in the CUDA
simulator: fresh random inputs, NaN-poisoned outputs, fp32 and fp16, every M variant's code path
(full steps, a guarded partial step, a partial last group of rows, bias on and off)."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.linear import gemv
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


def run_kernel(x, w, bias):
    M, N = x.shape[0], w.shape[0]
    out = torch.full((M, N), float("nan"), dtype=x.dtype)
    R, _ = gemv.tile_for(gemv.variant_for(M))
    b = bias if bias is not None else w[0]
    # One warp per block: the simulator's shuffle is exact only within a one-warp block.
    launch(
        gemv.gemv_kernel(M),
        (N + R - 1) // R,
        32,
        (x.numpy(), w.numpy(), b.numpy(), out.numpy(), bias is not None),
    )
    return out


def check(out, x, w, bias):
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = gemv.gemv_ref(x.float(), w.float(), None if bias is None else bias.float())
    if out.dtype == torch.float16:
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    else:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# (M, N, K): K = 8 * 32 * U exercises only full steps for M <= 2 (U = 8 -> 2048 is large for the
# simulator, so the M=1 case uses a partial step: 264 = one full 256-chunk pass of the guarded
# step plus one chunk); N odd leaves a partial last row group when R = 2.
CASES = [(1, 3, 264, True), (2, 2, 64, False), (3, 3, 1040, True), (8, 3, 24, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,with_bias", CASES)
def test_gemv_matches_linear(dtype, M, N, K, with_bias):
    x = torch.randn(M, K, dtype=dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    bias = torch.randn(N, dtype=dtype) if with_bias else None
    check(run_kernel(x, w, bias), x, w, bias)


def test_full_step_path():
    # M = 4 (R = 2, U = 4): K = 1024 is exactly one unguarded step; 1040 adds a guarded one.
    for K in (1024, 1040):
        x = torch.randn(4, K)
        w = torch.randn(2, K) / K**0.5
        check(run_kernel(x, w, None), x, w, None)


def test_supports_rejects_what_the_kernel_cannot_take():
    w = torch.randn(16, 64)
    assert not gemv.supports(torch.randn(1, 64), w)  # CPU tensors: the torch path
    assert gemv.gemv_cuda(torch.randn(2, 64), w).shape == (2, 16)  # falls back to gemv_ref
    with pytest.raises(ValueError, match="M = 1..8"):
        gemv.gemv_kernel(9)
    assert gemv.gemv_kernel(3) is gemv.gemv_kernel(4)  # M = 3 runs the M = 4 kernel


def test_dispatch_picks_gemv_and_env_switch(monkeypatch):
    from voltserve.kernels.dispatch import KernelDispatch

    monkeypatch.delenv("VOLTSERVE_GEMV", raising=False)
    assert KernelDispatch("cpu").impl["gemv"] == "ref"
    assert KernelDispatch("cuda").impl["gemv"] == "cuda"  # resolving touches no device
    monkeypatch.setenv("VOLTSERVE_GEMV", "0")
    assert KernelDispatch("cuda").impl["gemv"] == "ref"


def test_linear_routes_decode_rows_through_ops():
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.models.layers import Linear

    lin = Linear(64, {"a": 24, "b": 8}, True, torch.float32)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    ops = KernelDispatch("cpu", torch.float32)
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x, ops), torch.nn.functional.linear(x, lin.weight, lin.bias))


# ---- gemv_gate_up: the gate_up projection with silu_and_mul fused into its output -----------


def run_gate_up_kernel(x, w, bias):
    M, inter = x.shape[0], w.shape[0] // 2
    out = torch.full((M, inter), float("nan"), dtype=x.dtype)
    b = bias if bias is not None else w[0]
    launch(
        gemv.gemv_kernel(M, gemv.GATE_UP),
        inter,  # one warp (here: one block) per output column
        32,
        (x.numpy(), w.numpy(), b.numpy(), out.numpy(), bias is not None),
    )
    return out


# (M, inter, K, bias, dtype): every M of 1..8 once (5..7 run the M = 8 kernel with missing rows);
# the step is U * 256 = 1024 elements, so K = 1032 is one full step and a guarded one, the rest
# only guarded steps.
GATE_UP_CASES = [
    (1, 3, 1032, True, torch.float16),
    (2, 3, 264, False, torch.float32),
    (3, 2, 24, True, torch.float32),
    (4, 4, 16, False, torch.float16),
    (5, 2, 8, True, torch.float16),
    (6, 2, 24, False, torch.float32),
    (7, 3, 16, True, torch.float32),
    (8, 2, 16, False, torch.float16),
]


@pytest.mark.parametrize("M,inter,K,with_bias,dtype", GATE_UP_CASES)
def test_gemv_gate_up_matches_linear_then_silu(M, inter, K, with_bias, dtype):
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref

    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(2 * inter, K) * 2 / K**0.5).to(dtype)  # gate over silu's curved range
    bias = torch.randn(2 * inter, dtype=dtype) if with_bias else None
    out = run_gate_up_kernel(x, w, bias)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # The product in fp32, rounded to the storage dtype as the linear stores it, then silu_and_mul
    # in that dtype: what the unfused path computes.
    y = gemv.gemv_ref(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    ref = silu_and_mul_ref(y.float()).to(dtype)
    tol = dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert gemv.gemv_gate_up_ref(x, w, bias).shape == out.shape


def test_gemv_gate_up_host_side():
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref

    w = torch.randn(16, 32)
    x = torch.randn(3, 32)
    assert not gemv.supports_gate_up(x, w)  # CPU tensors: the torch path
    torch.testing.assert_close(gemv.gemv_gate_up_cuda(x, w), silu_and_mul_ref(x @ w.T))
    assert gemv.gemv_kernel(6, gemv.GATE_UP) is gemv.gemv_kernel(8, gemv.GATE_UP)
    assert gemv.gemv_kernel(8, gemv.GATE_UP) is not gemv.gemv_kernel(8)
    assert gemv.grid_for(1, 14336, gemv.GATE_UP) == 14336 // gemv.WARPS  # one warp per output
    src = gemv._source(2, *gemv.tile_for(2, gemv.GATE_UP), gemv.GATE_UP)
    assert "rw1 = row0 + N" in src and "_silu_mul(" in src


def test_dispatch_gemv_gate_up_and_env_switch(monkeypatch):
    from voltserve.kernels import registry
    from voltserve.kernels.dispatch import KernelDispatch

    monkeypatch.delenv("VOLTSERVE_GEMV", raising=False)
    assert KernelDispatch("cpu").impl["gemv_gate_up"] == "ref"
    assert KernelDispatch("cuda").impl["gemv_gate_up"] == "cuda"
    monkeypatch.setenv("VOLTSERVE_GEMV", "0")
    assert KernelDispatch("cuda").impl["gemv_gate_up"] == "ref"
    assert registry.ops()["gemv_gate_up"].capturable_ref
    assert KernelDispatch("cpu").linear_plan is None
