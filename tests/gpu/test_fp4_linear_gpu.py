"""FP4 linears on a real GPU (kernels/linear/fp4_linear.py: the GEMV up to 8 rows, with the gate_up
epilogue, and dequantize + cuBLAS above) against the reference (F.linear with the dequantized
weight, fp32) at Llama-3-8B shapes, NVFP4 and MXFP4, decode to prefill row counts; CUDA-graph
capture and replay. Skipped without CUDA."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, dequantize_fp4, make_fp4_weight

from tests.gpu.linear_ops import Ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
LLAMA = [(4096, 6144), (4096, 28672), (14336, 4096)]  # (K, N): qkv, gate_up, down
ROWS = [1, 3, 8, 17, 256, 2048]


@functools.cache
def weight(K: int, N: int, kind: str):
    gen = torch.Generator(device=DEV).manual_seed(K + N)
    g = 16 if kind == E4M3 else 32
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, device=DEV, dtype=torch.uint8)
    # block scales around 0.005 (weights ~ +-0.03): E4M3 0x18..0x28 times a global 2**-6, or
    # E8M0 2**-9 .. 2**-7
    lo, hi = (0x18, 0x28) if kind == E4M3 else (118, 121)
    scales = torch.randint(lo, hi, (N, K // g), generator=gen, device=DEV, dtype=torch.uint8)
    gscale = torch.full((N,), 2.0**-6 if kind == E4M3 else 1.0, device=DEV)
    return make_fp4_weight(packed, scales, gscale, g, kind)


@pytest.mark.parametrize("kind", [E4M3, E8M0])
@pytest.mark.parametrize("K,N", LLAMA)
def test_fp4_linear_matches_reference(kind, K, N):
    from voltserve.kernels.linear.fp4_linear import fp4_linear

    w = weight(K, N, kind)
    wd = dequantize_fp4(w)  # fp32
    ops = Ops()
    for T in ROWS:
        x = torch.randn(T, K, device=DEV).half()
        got = fp4_linear(x, w, None, ops)
        ref = F.linear(x.float(), wd)
        scale = x.float().abs() @ wd.abs().T
        assert ((got.float() - ref).abs() <= 2e-3 * scale + 1e-3).all(), (kind, K, N, T)


@pytest.mark.parametrize("T", [1, 8])
def test_fp4_gate_up_and_graph_replay(T):
    from voltserve.kernels.linear.fp4_linear import fp4_gate_up_silu

    K, N = 4096, 28672
    w = weight(K, N, E4M3)
    ops = Ops()
    x = torch.randn(T, K, device=DEV).half()
    ref = fp4_gate_up_silu(
        x.cpu().float(),
        make_fp4_weight(w.packed.cpu(), w.scales.cpu(), w.gscale.cpu(), w.group_size, w.scale_kind),
    )
    eager = fp4_gate_up_silu(x, w, None, ops)
    torch.testing.assert_close(eager.float().cpu(), ref, atol=3e-2, rtol=2e-2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp4_gate_up_silu(x, w, None, ops)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# The tiled GEMV's tiles beside the defaults ((R, U, KS): one or two chunks a lane, two rows a
# warp, split-K over 1, 2 and 4 warps) and the one-row-a-warp kernel, on the longest K (down)
# at 1, 2 and 5 rows.
TILES = [(4, 1, 1), (4, 2, 1), (4, 2, 2), (2, 2, 4), (4, 1, 4), "v1"]


@pytest.mark.parametrize("kind", [E4M3, E8M0])
@pytest.mark.parametrize("tile", TILES)
def test_fp4_gemv_tiles_match_reference(tile, kind):
    from voltserve.kernels.linear.fp4_linear import fp4_gemv_cuda

    K, N = 14336, 4096
    w = weight(K, N, kind)
    wd = dequantize_fp4(w)
    for T in (1, 2, 5):
        x = torch.randn(T, K, device=DEV).half()
        got = fp4_gemv_cuda(x, w, None, tile=tile)
        ref = F.linear(x.float(), wd)
        scale = x.float().abs() @ wd.abs().T
        assert ((got.float() - ref).abs() <= 2e-3 * scale + 1e-3).all(), (tile, kind, T)


@pytest.mark.parametrize("tile", [None, (4, 1, 1), (2, 2, 4), "v1"])
def test_fp4_gemv_gate_up_tiles(tile):
    from voltserve.kernels.linear.fp4_linear import fp4_gate_up_ref, fp4_gemv_cuda

    K, N = 4096, 28672
    w = weight(K, N, E8M0)
    for T in (1, 3):
        x = torch.randn(T, K, device=DEV).half()
        got = fp4_gemv_cuda(x, w, None, gate_up=True, tile=tile)
        ref = fp4_gate_up_ref(x.float(), w)
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)


def test_fp4_linear_k_not_a_multiple_of_32():
    """K a multiple of 16 only: no GEMV (gemv_supports), dequantize + cuBLAS at decode rows."""
    from voltserve.kernels.linear.fp4_linear import fp4_linear, gemv_supports

    K, N = 4096 + 16, 1024
    w = weight(K, N, E4M3)
    wd = dequantize_fp4(w)
    x = torch.randn(1, K, device=DEV).half()
    assert not gemv_supports(x, w)
    got = fp4_linear(x, w, None, Ops())
    scale = x.float().abs() @ wd.abs().T
    assert ((got.float() - F.linear(x.float(), wd)).abs() <= 2e-3 * scale + 1e-3).all()
