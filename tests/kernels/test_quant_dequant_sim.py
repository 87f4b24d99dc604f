"""The dequantize kernel (kernels/linear/quant_dequant.py, the prefill path's scratch fill) against
quant_pack.dequantize in the CUDA simulator: int4 and int8, groups 16 / 32 / K, fp16 and fp32,
a NaN-poisoned output, launched with the production grid (`grid_for`) and block. A lowered grid
limit folds the rows over gridDim.y and .z as a GPU launch does past 65,535 rows (a
vocabulary-sized weight), with idle blocks past the last row. Seeded: printed,
VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.linear import quant_dequant
from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))


@pytest.mark.parametrize(
    "bits,g,K,dtype,N,limit",
    [
        (4, 16, 64, torch.float32, 3, None),
        (4, 32, 160, torch.float16, 3, None),
        (8, 16, 48, torch.float16, 3, None),
        (8, 48, 48, torch.float32, 3, None),
        # rows past the grid's y limit: 7 rows folded as 2 x 4 and 3 x 3 (one and two idle)
        (4, 32, 64, torch.float16, 7, 2),
        (8, 16, 32, torch.float32, 7, 3),
        (4, 16, 32, torch.float32, 6, 3),  # 3 x 2, none idle
    ],
)
def test_dequant_kernel_matches_reference(bits, g, K, dtype, N, limit):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + K + bits)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    s = torch.rand(N, K // g, generator=gen) * 0.1
    o = torch.randn(N, K // g, generator=gen)
    w = pack_group_quant(codes, s, o, bits, g, dtype)
    out = torch.full((N, K), float("nan"), dtype=dtype)
    grid = quant_dequant.grid_for(w) if limit is None else quant_dequant.grid_for(w, limit)
    if limit is None:
        assert grid[1:] == (N, 1)
    else:
        assert grid[1] == limit and grid[2] == -(-N // limit)
    launch(
        quant_dequant._KERNELS[bits],
        grid,
        quant_dequant.THREADS,
        (w.qweight.numpy(), w.scales.numpy(), w.offsets.numpy(), out.numpy(), w.group_shift),
    )
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = dequantize(w)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:  # one fp16 rounding of the same fp32 value (an FMA may round differently: 1 ulp)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=1e-3)
