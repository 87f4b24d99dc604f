"""The GEMV with the residual add + RMSNorm as its last block's epilogue (kernels/gemv.py,
kind add_norm) in the CUDA simulator, against the two launches it replaces: the plain GEMV
kernel, then rmsnorm's one-chunk fused_add_rms_norm kernel. Same bits in the output and the
residual (the epilogue repeats that kernel's rounding and summation order), the arrival counter
back at zero, and a second launch on the same counter (the reset) equal to the unfused path
again. One warp per block as in test_gemv_sim.py, so a launch has tens of blocks and the ticket
decides which one runs the tail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import cuda
from voltserve.kernels import gemv, rmsnorm
from voltserve.kernels.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")

EPS = 1e-5


def unfused(x, w, bias, residual, weight):
    """The plain GEMV kernel, then the one-chunk fused_add_rms_norm kernel (what decode ran)."""
    M, N = x.shape[0], w.shape[0]
    R, _ = gemv.tile_for(gemv.variant_for(M))
    y = torch.full((M, N), float("nan"), dtype=x.dtype)
    b = bias if bias is not None else w[0]
    args = (x.numpy(), w.numpy(), b.numpy(), y.numpy(), bias is not None)
    launch(gemv.gemv_kernel(M), (N + R - 1) // R, 32, args)
    res = residual.clone()
    assert rmsnorm.one_chunk(M, N, True)
    launch(
        rmsnorm.fused_add_rms_norm_1c_kernel,
        M,
        rmsnorm.one_chunk_block(N),
        (y.numpy(), res.numpy(), weight.numpy(), np.float32(EPS)),
    )
    return y, res


def fused(x, w, bias, residual, weight, counter):
    """One add_norm launch; residual is updated in place, the normalised rows returned."""
    M, N = x.shape[0], w.shape[0]
    R, _ = gemv.tile_for(gemv.variant_for(M), gemv.ADD_NORM)
    out = torch.full((M, N), float("nan"), dtype=x.dtype)  # poisoned: every element written
    b = bias if bias is not None else w[0]
    args = (x.numpy(), w.numpy(), b.numpy(), out.numpy(), bias is not None)
    args += (residual.numpy(), weight.numpy(), np.float32(EPS), counter.numpy())
    launch(gemv.gemv_kernel(M, gemv.ADD_NORM), (N + R - 1) // R, 32, args)
    return out


# (M, N, K, bias, dtype, relaunch): M = 1 and 2 run R = 1 (8 blocks), M = 3 the M = 4 kernel
# (R = 2: 4 blocks, a missing input row). N = 8: the simulator takes 0.2-1.5 s a block, so one
# case launches twice. The tail's partial warp of chunks is in every case; rows wider than one
# tail group in test_tail_over_several_groups.
CASES = [
    (1, 8, 40, True, torch.float16, True),
    (2, 8, 16, False, torch.float32, False),
    (3, 8, 8, True, torch.float16, False),
]


def inputs(M, N, K, with_bias, dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    residual = torch.randn(M, N, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    return x, w, bias, residual, weight


@pytest.mark.parametrize("M,N,K,with_bias,dtype,relaunch", CASES)
def test_add_norm_epilogue_matches_the_two_launches(M, N, K, with_bias, dtype, relaunch):
    x, w, bias, residual, weight = inputs(M, N, K, with_bias, dtype)
    counter = torch.zeros(1, dtype=torch.int32)

    want_y, want_res = unfused(x, w, bias, residual, weight)
    res = residual.clone()
    got = fused(x, w, bias, res, weight, counter)
    assert torch.equal(got, want_y), "normalised rows differ from the two launches"
    assert torch.equal(res, want_res), "residual differs from the two launches"
    assert counter.item() == 0, "the last block did not reset the arrival counter"

    # The references (torch): the same meaning, up to the GEMV's summation order.
    ref_res = residual.clone()
    ref_y = gemv.gemv_add_rms_norm_ref(x, w, bias, ref_res, weight, EPS)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.float16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got.float(), ref_y.float(), **tol)
    torch.testing.assert_close(res.float(), ref_res.float(), **tol)

    if not relaunch:
        return
    # A second launch on the same counter (a graph replay) from the same residual: the reset
    # let it draw the tickets again, and the last block ran the tail again.
    res2 = residual.clone()
    got2 = fused(x, w, bias, res2, weight, counter)
    assert torch.equal(got2, want_y)
    assert torch.equal(res2, want_res)
    assert counter.item() == 0


@cuda.jit
def _tail_kernel(out, residual, weight, eps):
    gemv._add_norm_rows(out, residual, weight, eps)


def test_tail_over_several_groups():
    # One 32-thread block runs the tail alone: N = 1032 is three of its 512-element groups (the
    # last with one chunk), 3 rows, against the one-chunk norm kernel on the same y.
    _, _, _, residual, weight = inputs(3, 1032, 8, False, torch.float16)
    y = torch.randn(3, 1032).to(torch.float16)
    want_y, want_res = y.clone(), residual.clone()
    args = (want_y.numpy(), want_res.numpy(), weight.numpy(), np.float32(EPS))
    launch(rmsnorm.fused_add_rms_norm_1c_kernel, 3, rmsnorm.one_chunk_block(1032), args)
    launch(_tail_kernel, 1, 32, (y.numpy(), residual.numpy(), weight.numpy(), np.float32(EPS)))
    assert torch.equal(y, want_y)
    assert torch.equal(residual, want_res)


def test_host_checks_route_what_the_epilogue_cannot_take():
    x, w = torch.randn(1, 64), torch.randn(16, 64)
    res, nw = torch.randn(1, 16), torch.randn(16)
    assert not gemv.supports_add_norm(x, w, res, nw)  # CPU tensors: never the kernel
    # The launcher's fallback (what anything it cannot fuse runs) keeps the meaning.
    r1, r2 = res.clone(), res.clone()
    y = gemv.gemv_add_rms_norm_cuda(x, w, None, r1, nw, EPS, torch.zeros(1, dtype=torch.int32))
    want = gemv.gemv_ref(x, w)
    rmsnorm.fused_add_rms_norm_ref(want, r2, nw, EPS)
    assert torch.equal(y, want) and torch.equal(r1, r2)
    assert gemv.tile_for(1, gemv.ADD_NORM) == gemv.tile_for(1)
    assert gemv.grid_for(2, 4096, gemv.ADD_NORM) == gemv.grid_for(2, 4096)
