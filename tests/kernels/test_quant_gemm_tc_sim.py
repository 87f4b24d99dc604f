"""The tensor-core quantized GEMM's numba side (kernels/quant_gemm_tc.py) in the CUDA simulator,
with Python stand-ins for the two linked wmma functions (the simulator cannot run C++; their
PTX is checked by check-kernels and on the GPU): tile fills, dequantisation into the B tile,
the register pipelining over K steps, partial row and column tiles, split-K partials and their
reduction, bias, int4 (group 16 and 64) and int8, NaN-poisoned outputs. Seeded: printed,
VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels import quant_gemm_tc as tc
from voltserve.kernels.numba_common import SIM, launch
from voltserve.kernels.quant_pack import dequantize, pack_group_quant

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))


def run(x, w, bias, split):
    T, K = x.shape
    N = w.out_features
    cfg = tc.config_for(T)
    k_steps = K // tc.BK
    steps = -(-k_steps // split)
    S = -(-k_steps // steps)
    out = torch.full((T, N), float("nan"), dtype=torch.float16)
    part = np.full(S * T * N if S > 1 else 1, np.nan, dtype=np.float32)
    b = bias if bias is not None else w.scales[:, 0].contiguous()
    launch(
        tc.qgemm_kernel(cfg, w.bits),
        (-(-N // tc.BN), -(-T // cfg.bm), S),
        tc.THREADS,
        (
            x.reshape(-1).numpy(),
            w.qweight.numpy(),
            w.scales.numpy(),
            w.offsets.numpy(),
            b.numpy(),
            out.numpy(),
            part,
            bias is not None,
            w.group_shift,
            T,
            steps,
        ),
    )
    if S > 1:
        launch(
            tc.qgemm_reduce_kernel,
            -(-T * N // 64),
            64,
            (part, b.numpy(), out.numpy(), bias is not None, S),
        )
    return out


# (T, N, K, bits, g, bias, split): T 5 and 17 and 40 pick the 16-, 32- and 64-row tiles (40: a
# partial row tile); N = 70 leaves a partial column tile; K = 128 is two pipelined steps.
CASES = [
    (5, 70, 128, 4, 16, True, 1),
    (17, 64, 128, 4, 64, False, 2),
    (40, 70, 128, 8, 32, True, 1),
    (9, 64, 192, 8, 16, False, 3),
]


@pytest.mark.parametrize("T,N,K,bits,g,with_bias,split", CASES)
def test_qgemm_tc_numba_side(T, N, K, bits, g, with_bias, split):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + T * 100 + bits)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    s = (torch.rand(N, K // g, generator=gen) + 0.5) * (0.5 / 2**bits)
    o = -s * 2 ** (bits - 1) + torch.randn(N, K // g, generator=gen) * 0.01
    w = pack_group_quant(codes, s, o, bits, g, torch.float16)
    x = torch.randn(T, K, generator=gen).half()
    bias = torch.randn(N, generator=gen).half() if with_bias else None
    out = run(x, w, bias, split)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # The B tile holds fp16 weights: the reference with the fp16-rounded dequantized weight.
    ref = F.linear(
        x.float(), dequantize(w, torch.float16).float(), None if bias is None else bias.float()
    )
    torch.testing.assert_close(out.float(), ref, atol=5e-3, rtol=5e-3)


def test_split_and_config_rules():
    assert tc.config_for(9).bm == 16 and tc.config_for(32).bm == 32 and tc.config_for(33).bm == 64
    assert tc.split_for(tiles=600, k_steps=64, sms=132) == 1
    assert tc.split_for(tiles=64, k_steps=64, sms=132) == 5
    assert tc.split_for(tiles=64, k_steps=8, sms=132) == 2  # at least 4 K steps a slice
