"""The fused group-quantized MoE decode kernels (kernels/moe/quant_decode.py) against their
torch reference (moe_experts_ref on the dequantized experts) in the CUDA simulator: int4 codes
with group 32 and 16 (the SPLIT variant), int8 with group 16, fp16 and fp32, NaN-poisoned
intermediate and outputs, an expert that receives no token and one that receives every token.
Fresh random inputs; the seed is printed (replay: VOLTSERVE_TEST_SEED=<seed>)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear.quant_gemv import GATE_UP, is_split
from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant
from voltserve.kernels.moe import quant_decode as mq
from voltserve.kernels.runtime.numba_common import SIM, launch

from tests.kernels.test_moe_sim import _routing

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return random.Random(seed)


def _packed(gen, rows, K, bits, g, dtype):
    """A flat stacked weight [E * N, K] (rows packed independently, as quant/experts.py stacks)."""
    codes = torch.randint(0, 2**bits, (rows, K), generator=gen, dtype=torch.uint8)
    s = (torch.rand(rows, K // g, generator=gen) + 0.5) * (2.0 / (K**0.5 * 2**bits))
    o = -s * 2 ** (bits - 1) + torch.randn(rows, K // g, generator=gen) * 0.01
    return pack_group_quant(codes, s, o, bits, g, dtype)


def _run(x, w13, w2, wts, ids):
    """moe_quant_decode's two launches with host arrays (the simulator), h and out poisoned,
    each with the dot-product form the launcher picks (mq.form_for)."""
    T, H = x.shape
    k, inter = ids.shape[1], w2.in_features
    h = torch.full((T * k, inter), float("nan"), dtype=x.dtype)
    out = torch.full((T, H), float("nan"), dtype=x.dtype)
    launch(
        mq.moe_qkernel(GATE_UP, w13.bits, is_split(w13), mq.form_for(x.dtype, w13)),
        mq.grid(GATE_UP, w13.bits, inter, T * k),
        32 * mq.WARPS,
        (
            x.numpy(),
            w13.qweight.numpy(),
            w13.scales.numpy(),
            w13.offsets.numpy(),
            ids.numpy(),
            h.numpy(),
            w13.group_shift,
        ),
    )
    gate_up = h.clone()
    launch(
        mq.moe_qkernel(mq.DOWN, w2.bits, is_split(w2), mq.form_for(x.dtype, w2)),
        mq.grid(mq.DOWN, w2.bits, H, T),
        32 * mq.WARPS,
        (
            h.numpy(),
            w2.qweight.numpy(),
            w2.scales.numpy(),
            w2.offsets.numpy(),
            ids.numpy(),
            wts.float().numpy(),
            out.numpy(),
            w2.group_shift,
        ),
    )
    return gate_up, out


def _tol(dtype):
    # the kernel dequantizes in fp32, the reference rounds each weight to the dtype first
    return dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


# (T, bits, group, dtype), H = 32, I = 32 for int4 (one 16-byte chunk of codes per row, lanes
# 1..31 guarded) and 16 for int8 (gate_up rows of two chunks in two groups, down rows of one).
# Few, small cases: every simulated lane runs the whole generated step, and a one-warp block of
# gate_up owns R / 2 columns of one pair, one of down R rows of one token (I sets gate_up's
# block count, H down's).
CASES = [
    # SPLIT (a chunk spans two groups), routing weight folded in both halves; one token (its
    # blocks cost the most: the pair and token indexing is the same source for every bits)
    (1, 4, 16, torch.float16),
    (2, 8, 16, torch.float32),  # two tokens, two pairs each
    # int4, group 32, fp16: the half2 form (fp16 runs of 16 products per half; their error,
    # ~2**-11 of a run's magnitude, is within the fp16 tolerance at these magnitudes), the
    # routing weight folded into each chunk's fp32 scale and offset
    (1, 4, 32, torch.float16),
]


@pytest.mark.parametrize("T,bits,g,dtype", CASES)
def test_fused_quant_experts_match_the_reference(rng, T, bits, g, dtype):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    E, k, H, inter = 3, 2, 32, 32 if bits == 4 else 16
    w13 = _packed(gen, E * 2 * inter, H, bits, g, dtype)
    w2 = _packed(gen, E * H, inter, bits, g, dtype)
    x = torch.randn(T, H, generator=gen).to(dtype)
    # expert 1 receives every token, expert 2 none
    wts, ids = _routing(gen, T, E, k, all_to=1, skip=2)
    gate_up, out = _run(x, w13, w2, wts, ids)
    assert not torch.isnan(gate_up.float()).any(), "gate_up left poisoned (NaN) outputs"
    assert not torch.isnan(out.float()).any(), "down left poisoned (NaN) outputs"
    # gate_up per pair against the dequantized expert rows
    d13 = dequantize(w13, torch.float32).view(E, 2 * inter, H)
    pairs = ids.reshape(-1).long()
    xs = x.float().repeat_interleave(k, 0)
    y = torch.bmm(d13[pairs], xs.unsqueeze(-1)).squeeze(-1)
    want_h = silu_and_mul_ref(y.to(dtype).float()).to(dtype)
    torch.testing.assert_close(gate_up.float(), want_h.float(), **_tol(dtype))
    ref = mq.moe_quant_experts_ref(x, w13, w2, wts, ids)
    assert ref.abs().max() > 0
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


def test_host_side_rules():
    gen = torch.Generator().manual_seed(0)
    w13 = _packed(gen, 4 * 64, 64, 4, 32, torch.float32)
    w2 = _packed(gen, 4 * 64, 32, 4, 32, torch.float32)
    x = torch.randn(2, 64)
    assert not mq.supports(x, w13, w2, 2)  # a CPU tensor: the caller's other path
    with pytest.raises(ValueError, match="kind"):
        mq.moe_qkernel("plain", 4)
    with pytest.raises(ValueError, match="SPLIT"):
        mq.moe_qkernel(GATE_UP, 8, split=True)
    with pytest.raises(ValueError, match="half2"):
        mq.moe_qkernel(GATE_UP, 8, form="half2")
    with pytest.raises(ValueError, match="form"):
        mq.moe_qkernel(mq.DOWN, 4, form="factored")
    w16 = _packed(gen, 4 * 64, 64, 4, 16, torch.float16)
    assert (
        mq.form_for(torch.float16, w13) == "half2" and mq.form_for(torch.float32, w13) == "weight"
    )
    assert mq.form_for(torch.float16, w16) == "weight"  # split groups


def test_fused_kernels_take_batches_while_they_read_fewer_bytes() -> None:
    from voltserve.kernels.moe.quant_decode import fused_pays

    assert fused_pays(1, 8, 128) and fused_pays(8, 2, 8)  # decode sizes: always
    assert fused_pays(128, 8, 128) and not fused_pays(129, 8, 128)  # Qwen3-30B-A3B: T*k <= 8E
    assert fused_pays(32, 2, 8) and not fused_pays(33, 2, 8)  # Mixtral
    assert not fused_pays(0, 8, 128)
    assert not fused_pays(9000, 8, 1 << 20)  # the grid's pair limit
