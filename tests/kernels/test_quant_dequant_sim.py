"""The dequantize kernel (kernels/quant_dequant.py, the prefill path's scratch fill) against
quant_pack.dequantize in the CUDA simulator: int4 and int8, groups 16 / 32 / K, fp16 and fp32,
a NaN-poisoned output. Seeded: printed, VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels import quant_dequant
from voltserve.kernels.numba_common import SIM, launch
from voltserve.kernels.quant_pack import dequantize, pack_group_quant

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))


@pytest.mark.parametrize(
    "bits,g,K,dtype",
    [
        (4, 16, 64, torch.float32),
        (4, 32, 160, torch.float16),
        (8, 16, 48, torch.float16),
        (8, 48, 48, torch.float32),
    ],
)
def test_dequant_kernel_matches_reference(bits, g, K, dtype):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + K + bits)
    N = 3
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    s = torch.rand(N, K // g, generator=gen) * 0.1
    o = torch.randn(N, K // g, generator=gen)
    w = pack_group_quant(codes, s, o, bits, g, dtype)
    out = torch.full((N, K), float("nan"), dtype=dtype)
    chunks = -(-w.qweight.shape[1] // 4)
    launch(
        quant_dequant._KERNELS[bits],
        (chunks, N),  # one thread per block in the simulator is enough and fast
        1,
        (w.qweight.numpy(), w.scales.numpy(), w.offsets.numpy(), out.numpy(), w.group_shift),
    )
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = dequantize(w)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:  # one fp16 rounding of the same fp32 value (an FMA may round differently: 1 ulp)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=1e-3)
