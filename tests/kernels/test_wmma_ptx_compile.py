"""The tensor-core device functions (kernels/runtime/wmma_ptx.cu) compile to PTX for compute_70 with
the CUDA 12 NVRTC from pip (no GPU, no driver), hold Volta's wmma instructions, and link with the
numba kernel that calls them into an sm_70 cubin (nvJitLink): the extern prototypes numba
emits match the C++ definitions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from voltserve.kernels.runtime.check import check_ptx, compile_cu_ptx
from voltserve.kernels.runtime.wmma_ptx import WMMA_CU

SIG = "void(float32[::1], float16[::1], float16[::1], int32, int32)"  # wmma_gemm16_kernel

# The cc 7.0 compile check is CI's job (CUDA 12 NVVM from pip, no GPU). GPU hosts here run the
# CUDA 13 toolkit of their image, which dropped Volta, so there the check cannot target 7.0.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cc 7.0 compile check runs in CI with the CUDA 12 NVVM"
)


@pytest.mark.xdist_group("cc70")
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the shared compile of every kernel runs in this test's setup
def test_wmma_cu_compiles_for_volta(cc70_check):
    # The PTX that `voltserve check-kernels` compiled from the .cu (NVRTC, compute_70).
    ptx = (cc70_check.ptx_dir / f"{Path(WMMA_CU).name}.ptx").read_text()
    assert ptx == compile_cu_ptx(WMMA_CU, (7, 0))  # the same NVRTC run as here: seconds
    check_ptx(ptx, (7, 0))  # .target sm_70, nothing Volta lacks
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    assert "wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32" in ptx
    for op in ("wmma.load.a.sync", "wmma.load.b.sync", "wmma.store.d.sync"):
        assert op in ptx, op
    for fn in ("vs_wmma_gemm16", "vs_moe_tile16x64"):
        assert f".visible .func  (.param .b32 func_retval0) {fn}(" in ptx, fn


@pytest.mark.xdist_group("cc70")
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the shared compile of every kernel runs in this test's setup
def test_wmma_kernel_links_for_volta(cc70_check):
    """The numba kernel's PTX and the .cu's, linked by nvJitLink into one sm_70 cubin (the check
    links every kernel of a module with CUDA_SOURCES): the extern prototype numba emits matches
    the C++ definition."""
    name = "runtime.wmma_ptx.wmma_gemm16_kernel"
    ptx = cc70_check.ptx(name, SIG)
    assert ".extern .func  (.param .b32 func_retval0) vs_wmma_gemm16" in ptx
    r = cc70_check.result(name, SIG)
    assert r["error"] is None, r
    assert r["registers"] > 0 and r["shared_bytes"] <= 48 * 1024, r
