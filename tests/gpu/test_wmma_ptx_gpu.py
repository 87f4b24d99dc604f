"""The building block of the linked tensor-core C++ (kernels/runtime/wmma_ptx.cu, through
kernels/runtime/wmma_ptx.py) on a real GPU: one warp's 16x16 tile product through the linked PTX (A
row-major, B row- or column-major, k = 16 and 64) against torch in fp32. fp16 products are exact
in fp32 and the sums are fp32, so the bound is 1e-4 absolute for |a|, |b| <= 1 at k <= 64.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("k", [16, 64])
@pytest.mark.parametrize("b_col", [0, 1])
def test_wmma_tile(k, b_col):
    from voltserve.kernels.runtime.numba_common import current_stream, launch
    from voltserve.kernels.runtime.wmma_ptx import wmma_gemm16_kernel

    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.rand((16, k), generator=gen, device="cuda") * 2 - 1).half()
    b = (torch.rand((k, 16), generator=gen, device="cuda") * 2 - 1).half()
    b_in = b.t().contiguous() if b_col else b  # column-major b == row-major b^T
    d = torch.full((16, 16), float("nan"), device="cuda")
    args = (d.view(-1), a.view(-1), b_in.view(-1), k, b_col)
    launch(wmma_gemm16_kernel, 1, 32, args, current_stream())
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = (d - ref).abs().max().item()
    assert not d.isnan().any(), f"NaN in tile result:\n{d}"
    assert err <= 1e-4, f"k={k} b_col={b_col}: max error {err:.3e}\nout:\n{d}\nref:\n{ref}"
