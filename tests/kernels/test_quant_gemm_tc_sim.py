"""The tensor-core quantized GEMM's numba side (kernels/linear/quant_gemm_tc.py) in the CUDA
simulator, with Python stand-ins for the two linked wmma functions (the simulator cannot run C++;
their PTX is checked by check-kernels and on the GPU): tile fills, dequantisation into the B tile,
the register pipelining over K steps, the zero-filled K tail of a 128 step, partial row and
column tiles, every tile config (16, 32, 64 and 128 rows; 4 and 8 warps), split-K partials and
their reduction, bias, int4 (groups 16 to 128) and int8, NaN-poisoned outputs. Seeded by the
project's `seed` fixture (tests/conftest.py; VOLTSERVE_TEST_SEED replays it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.linear import quant_gemm_tc as tc
from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


def run(x, w, bias, split, cfg=None):
    T, K = x.shape
    N = w.out_features
    cfg = cfg or tc.config_for(T)
    k_steps = -(-K // cfg.bk)
    steps = -(-k_steps // split)
    S = -(-k_steps // steps)
    out = torch.full((T, N), float("nan"), dtype=torch.float16)
    part = np.full(S * T * N if S > 1 else 1, np.nan, dtype=np.float32)
    b = bias if bias is not None else w.scales[:, 0].contiguous()
    launch(
        tc.qgemm_kernel(cfg, w.bits),
        (-(-N // cfg.bn), -(-T // cfg.bm), S),
        cfg.threads,
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


# (T, N, K, bits, g, bias, split, cfg). cfg None: `config_for` (16, 32 and 64 rows: 4, 8 and 8
# warps; beyond 64, 128-row tiles of 16 warps; K steps of 64). N = 70 leaves a partial column
# tile. The explicit configs take K steps of 128 (K = 192 and 64 end in a half-filled step, the
# K tail) and the 2 x 2 fragments a warp, which no default config uses.
BK128_W11 = tc.TileConfig(1, 4, 1, 1, 128)
BK128_W22 = tc.TileConfig(2, 2, 2, 2, 128)
CASES = [
    (5, 70, 128, 4, 16, True, 1, None),  # int4 group 16: two groups in one code chunk
    (17, 64, 128, 4, 64, False, 2, None),  # 32-row tile, split-K
    (40, 70, 128, 8, 32, True, 1, None),  # partial 64-row tile, int8
    (9, 64, 192, 8, 16, False, 3, None),  # three pipelined steps, one a split
    (64, 64, 128, 4, 128, True, 1, None),  # full 64-row tile: 2 threads a code chunk
    (33, 70, 128, 4, 16, False, 1, None),  # 2 threads a chunk, one group 16 each
    (77, 64, 128, 4, 16, True, 1, None),  # 128-row tile: 4 threads a code chunk, 8 codes each
    (130, 64, 64, 8, 64, False, 1, None),  # two 128-row tiles (the second 2 rows), int8 split
    (9, 70, 192, 4, 32, True, 2, BK128_W11),  # K tail: the second split is the tail alone
    (33, 64, 64, 8, 32, False, 1, BK128_W22),  # one half-filled step, 2 x 2 fragments
    # Two load stages and wider weight tiles (quant_gemm_tc.CANDIDATES): 1 x 4 fragments a warp
    # (BN 256, a partial column tile), a 3-step K with stages 2 (the third load issued in step
    # 1), split-K slices of 2 steps, BN 128 at 128 rows; one thread block along each axis where
    # the case needs no more (the simulator runs every thread of every block).
    (20, 130, 128, 4, 32, True, 1, tc.TileConfig(1, 4, 1, 4, 64, 2)),
    (24, 200, 192, 8, 32, False, 1, tc.TileConfig(2, 4, 1, 2, 64, 2)),
    (64, 120, 256, 4, 64, True, 2, tc.TileConfig(2, 2, 2, 4, 64, 2)),
    (100, 120, 128, 4, 16, False, 1, tc.TileConfig(4, 2, 2, 4, 64, 1)),
]


@pytest.mark.parametrize("T,N,K,bits,g,with_bias,split,cfg", CASES)
def test_qgemm_tc_numba_side(T, N, K, bits, g, with_bias, split, cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    s = (torch.rand(N, K // g, generator=gen) + 0.5) * (0.5 / 2**bits)
    o = -s * 2 ** (bits - 1) + torch.randn(N, K // g, generator=gen) * 0.01
    w = pack_group_quant(codes, s, o, bits, g, torch.float16)
    x = torch.randn(T, K, generator=gen).half()
    bias = torch.randn(N, generator=gen).half() if with_bias else None
    out = run(x, w, bias, split, cfg)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # The B tile holds fp16 weights: the reference with the fp16-rounded dequantized weight.
    ref = F.linear(
        x.float(), dequantize(w, torch.float16).float(), None if bias is None else bias.float()
    )
    torch.testing.assert_close(out.float(), ref, atol=5e-3, rtol=5e-3)


def test_split_and_config_rules():
    assert [tc.config_for(t).bm for t in (1, 16, 17, 32, 33, 64, 65, 256)] == [
        16,
        16,
        32,
        32,
        64,
        64,
        128,
        128,
    ]
    candidates = [c for cs in tc.CANDIDATES.values() for c in cs]
    for cfg in [*tc.CONFIGS.values(), *candidates]:
        assert cfg.bk % 16 == 0 and cfg.wn in (1, 2, 4) and cfg.stages in (1, 2)
        lda = ldb = cfg.bk + tc.PAD  # the three shared tiles stay under 48 KiB (static)
        shared = 2 * (cfg.bm * lda + cfg.bn * ldb) + 4 * cfg.warps * 16 * tc.LDS
        assert shared == cfg.shared_bytes() <= 48 * 1024, (cfg, shared)
    for bm, cs in tc.CANDIDATES.items():
        assert all(c.bm == bm for c in cs), bm
    assert [tc.config_for(t).threads for t in (16, 32, 64, 256)] == [128, 256, 256, 512]
    assert tc.split_for(tiles=600, k_steps=64, sms=132) == 1
    assert tc.split_for(tiles=64, k_steps=64, sms=132) == 5
    assert tc.split_for(tiles=64, k_steps=8, sms=132) == 2  # at least 4 K steps a slice
    # 8 and 16 warps a block: one block an SM is the target
    assert tc.split_for(tiles=64, k_steps=64, sms=132, warps=8) == 3
    assert tc.split_for(tiles=128, k_steps=64, sms=132, warps=16) == 1  # 128 >= 7/8 of 132
    assert tc.split_for(tiles=64, k_steps=64, sms=132, warps=16) == 3
