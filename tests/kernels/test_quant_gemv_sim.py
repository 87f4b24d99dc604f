"""The fused dequantize-GEMV (kernels/linear/quant_gemv.py) against F.linear with the dequantized
weight in the CUDA simulator: int4 and int8 codes, group sizes 16 (the SPLIT variant), 32, 128 and
K, 1, 3 and 8 rows, bias on and off, fp16 and fp32, NaN-poisoned outputs, a guarded partial step
and a partial last group of rows; the gate_up variant against linear then silu_and_mul.
Seeded: the seed is printed, VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear import quant_gemv
from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))


def make(gen, N, K, bits, g, dtype, with_codes=False):
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    G = K // g
    s = (torch.rand(N, G, generator=gen) + 0.5) * (2.0 / (K**0.5 * 2**bits))
    o = -s * 2 ** (bits - 1) + torch.randn(N, G, generator=gen) * 0.01
    w = pack_group_quant(codes, s, o, bits, g, dtype)
    return (w, codes) if with_codes else w


def run(x, w, bias, kind=quant_gemv.PLAIN, form="weight", out_dtype=None):
    M = x.shape[0]
    cols = w.out_features // 2 if kind == quant_gemv.GATE_UP else w.out_features
    out = torch.full((M, cols), float("nan"), dtype=out_dtype or x.dtype)
    R, U = quant_gemv.tile_for(quant_gemv.variant_for(M), w.bits, kind)
    warps = -(-cols // (R // 2)) if kind == quant_gemv.GATE_UP else -(-cols // R)
    b = bias if bias is not None else w.scales[:, 0].contiguous()
    # One warp per block: the simulator's shuffle is exact only within a one-warp block, so no
    # split-K here (KS = 1 at the default's (R, U); the split-K tests cover KS 2 and 4).
    launch(
        quant_gemv.qgemv_kernel(M, w.bits, quant_gemv.is_split(w), kind, (R, U, 1), form),
        warps,
        32,
        (
            x.numpy(),
            w.qweight.numpy(),
            w.scales.numpy(),
            w.offsets.numpy(),
            b.numpy(),
            out.numpy(),
            bias is not None,
            w.group_shift,
        ),
    )
    return out


def tol(dtype):
    return dict(atol=3e-3, rtol=3e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


# (M, N, bits, g, K, bias, dtype). A warp step of the M = 1 int4 kernel (U = 4) covers 4096
# inputs: K = 4096 + 128 is one full step and a partial one; small K only a partial step. N not
# a multiple of R leaves a partial last group of rows.
CASES = [
    (1, 3, 4, 32, 4224, True, torch.float16),
    (3, 5, 4, 16, 128, False, torch.float32),
    (8, 6, 4, 128, 256, True, torch.float16),
    (1, 2, 4, 64, 64, False, torch.float32),  # g = K (power of two)
    (2, 3, 8, 16, 64, True, torch.float32),
    (8, 3, 8, 32, 96, False, torch.float16),
    (3, 4, 8, 48, 48, True, torch.float16),  # g = K, per-channel shift
]


@pytest.mark.parametrize("M,N,bits,g,K,with_bias,dtype", CASES)
def test_qgemv_matches_dequantized_linear(M, N, bits, g, K, with_bias, dtype):
    gen = torch.Generator().manual_seed(SEED + M * 1000 + K)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    w = make(gen, N, K, bits, g, dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    out = run(x, w, bias)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = F.linear(x.float(), dequantize(w, torch.float32), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


@pytest.mark.parametrize(
    "M,inter,bits,g,dtype",
    [(1, 2, 4, 32, torch.float16), (3, 3, 8, 16, torch.float32), (8, 2, 4, 16, torch.float32)],
)
def test_qgemv_gate_up(M, inter, bits, g, dtype):
    gen = torch.Generator().manual_seed(SEED + 7 * M)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    K = 128
    w = make(gen, 2 * inter, K, bits, g, dtype)
    x = (torch.randn(M, K, generator=gen) * 2).to(dtype)
    bias = torch.randn(2 * inter, generator=gen).to(dtype) if M != 3 else None
    out = run(x, w, bias, quant_gemv.GATE_UP)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    y = F.linear(x.float(), dequantize(w, torch.float32), None if bias is None else bias.float())
    ref = silu_and_mul_ref(y.to(dtype).float()).to(dtype)
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


# The factored dot product (fp16 x at 1-2 rows by default): int4 groups 32 (one full step of
# the M = 1 kernel, 2048 inputs, and a partial one) and 16 (SPLIT), int8, 2 and 3 inputs, bias.
FACTORED_CASES = [
    (1, 5, 4, 32, 2048 + 128, True),
    (1, 3, 4, 16, 128, False),
    (2, 3, 8, 16, 64, True),
    (2, 4, 4, 128, 256, False),
    (3, 3, 4, 64, 64, True),  # the M = 4 kernel (R = 4, U = 1), row 3 clamped to row 2
]


@pytest.mark.parametrize("M,N,bits,g,K,with_bias", FACTORED_CASES)
def test_qgemv_factored_matches_dequantized_linear(M, N, bits, g, K, with_bias):
    gen = torch.Generator().manual_seed(SEED + 3 * M + K)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    w = make(gen, N, K, bits, g, torch.float16)
    # x over fp16's range (its scaling must neither overflow nor leave products subnormal);
    # with M >= 2, row 1 only of fp16 subnormals (2**-24 .. 2**-15), whose sums nothing hides.
    x = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-20, 12, (M, K), generator=gen))
    if M > 1:
        x[1] = torch.randint(-(2**9), 2**9, (K,), generator=gen) * 2.0**-24
    x = x.to(torch.float16)
    bias = torch.randn(N, generator=gen).to(torch.float16) if with_bias else None
    wd = dequantize(w, torch.float32).double()
    ref = F.linear(x.double(), wd, None if bias is None else bias.double())
    # fp32 out (the simulator stores what it is given): the sum before fp16 rounding, within
    # fp32's error relative to sum |x w| + |bias| (what the regrouped sums can lose).
    out = run(x, w, bias, form="factored", out_dtype=torch.float32)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    mag = F.linear(x.double().abs(), wd.abs(), None if bias is None else bias.double().abs())
    err = (out.double() - ref).abs()
    assert (err <= 3e-5 * mag).all(), f"worst {(err / mag).max():.3g} of sum |x w|"
    out16 = run(x, w, bias, form="factored")
    torch.testing.assert_close(out16.float(), ref.float().to(torch.float16).float(), **tol(x.dtype))


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("kind", [quant_gemv.GATE_UP, quant_gemv.QKV_ROPE])
def test_qgemv_forms_kinds(kind, M):
    """gate_up and qkv_rope share the step: the factored and half2 ones give what the per-weight
    one does. x = i / 8 (|i| <= 8) keeps the half2 form's fp16 sums exact (every partial sum a
    multiple of 2**-11 below 1), so the forms differ by fp32 rounding only."""
    gen = torch.Generator().manual_seed(SEED + 5 + M)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    K, N = 128, 6  # gate_up: 3 columns, R / 2 = 2 a warp (the second half-used); 3 pairs
    w = make(gen, N, K, 4, 32, torch.float16)
    x = (torch.randint(-8, 9, (M, K), generator=gen) / 8).to(torch.float16)
    forms = ("weight", "factored", "half2")
    if kind == quant_gemv.GATE_UP:
        outs = [run(x, w, None, kind, f, torch.float32) for f in forms]
    else:
        outs = []
        for f in forms:
            out = torch.full((M, N), float("nan"))
            cache = torch.zeros(1, 1, 1, 2)
            launch(
                quant_gemv.qgemv_kernel(M, 4, False, kind, form=f),
                N // 2,
                32,
                (x.numpy(), w.qweight.numpy(), w.scales.numpy(), w.offsets.numpy())
                + (w.scales.view(-1).numpy(), out.numpy(), False, w.group_shift)
                + (np.zeros(M, np.int64), np.ones((1, 2), np.float32), cache.numpy())
                + (cache.numpy(), np.full(M, -1, np.int64), 2, 0),
            )
            outs.append(out)
    for out in outs[1:]:
        assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


def test_form_choice():
    f16, f32 = torch.float16, torch.float32
    form_for = quant_gemv.form_for
    # fp16 x: half2 for int4 with whole-chunk groups, factored for int8 and split groups at 1-2
    # rows, per weight beyond; fp32 x: always per weight.
    assert form_for(1, f16) == form_for(2, f16) == form_for(3, f16) == form_for(8, f16) == "half2"
    assert form_for(1, f16, 8) == form_for(2, f16, 4, True) == "factored"
    assert form_for(3, f16, 8) == form_for(8, f16, 4, True) == form_for(1, f32) == "weight"
    assert form_for(8, f16, force="half2") == "half2"
    assert form_for(1, f16, force="factored") == "factored"
    assert form_for(1, f16, 4, True, force="half2") == "factored"  # split groups: no half2
    assert form_for(1, f32, force="half2") == "weight"  # fp32 x: its range needs the other
    with pytest.raises(ValueError, match="unknown"):
        form_for(1, f16, force="fp16")
    src = quant_gemv._source(1, 4, 2, 4, False, quant_gemv.PLAIN, form="factored")
    assert "fold_dot(" in src and "fold(" not in src
    src = quant_gemv._source(1, 4, 2, 4, False, quant_gemv.PLAIN, form="half2")
    assert "h2fma(" in src and "ldh8(x, (0, xc1_3)) if xc1_3 < K else ZERO_W4" in src
    assert "fold" not in src and "bits_f32" not in src
    with pytest.raises(ValueError, match="routing weight"):
        quant_gemv.dot_step("", 1, 2, 1, 4, False, ["0"], weight="ws", form="factored")
    with pytest.raises(ValueError, match="int4"):
        quant_gemv.qgemv_kernel(1, 8, form="half2")
    with pytest.raises(ValueError, match="int4"):
        quant_gemv.dot_step("", 1, 2, 1, 4, True, ["0"], form="half2")


# ---- the half2 form (fp16 x, int4, one group per chunk: the default at 1-2 rows) --------------


def half2_bound(x, w, codes, bias):
    """The half2 form's worst-case error against the exact sum (quant_gemv's module doc): each
    fp16 run of 16 terms x_k (c_k - 8) 2**-8, or x_k 2**-8, rounds 16 times, each time by at
    most 2**-11 of the running sum (<= the sum of the terms' magnitudes, to first order) or by
    2**-25 (half the subnormal spacing); the runs are scaled by 2**8 |s| and 2**8 |o + 8 s|.
    Plus fp32 rounding: 2**-20 of sum |x w| + |bias| (generous for these K)."""
    g = 1 << w.group_shift
    s = w.scales.double().repeat_interleave(g, dim=1)
    o = w.offsets.double().repeat_interleave(g, dim=1)
    c = codes.double() - 8
    xa = x.double().abs()
    run_err = F.linear(xa, s.abs() * c.abs() + (o + 8 * s).abs()) * 2.0**-7 * 1.01
    subnormal = (s.abs() + (o + 8 * s).abs()).sum(dim=1) * 2.0**-17
    wd = dequantize(w, torch.float32).double()
    fp32 = F.linear(xa, wd.abs(), None if bias is None else bias.double().abs()) * 2.0**-20
    return run_err + subnormal + fp32


# (M, N, g, K, bias, x): N not a multiple of R = 4 (a partial last group of rows); K = 2048 +
# 128: one full step of the M = 1 kernel (R = 4, U = 2) and a guarded partial one.
HALF2_CASES = [
    (1, 5, 32, 2048 + 128, True, "normal"),
    (2, 3, 128, 256, False, "normal"),
    (2, 5, 64, 128, True, "huge"),  # |x| up to 65504: the 2**-8 scaling keeps fp16 finite
    (1, 3, 32, 128, False, "tiny"),  # |x| ~ 1e-4: scaled x and products are fp16 subnormals
    (3, 5, 32, 128, True, "normal"),  # the M = 4 kernel (R = 4, U = 1), input 3 clamped to 2
]


@pytest.mark.parametrize("M,N,g,K,with_bias,xs", HALF2_CASES)
def test_qgemv_half2_error_bound(M, N, g, K, with_bias, xs):
    gen = torch.Generator().manual_seed(SEED + 17 * M + K)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    w, codes = make(gen, N, K, 4, g, torch.float16, with_codes=True)
    x = torch.randn(M, K, generator=gen)
    if xs == "huge":
        x = torch.sign(x) * (30000 + 35504 * torch.rand(M, K, generator=gen))
    elif xs == "tiny":
        x = x * 1e-4
    x = x.to(torch.float16)
    bias = torch.randn(N, generator=gen).to(torch.float16) if with_bias else None
    wd = dequantize(w, torch.float32).double()
    ref = F.linear(x.double(), wd, None if bias is None else bias.double())
    out = run(x, w, bias, form="half2", out_dtype=torch.float32)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    err = (out.double() - ref).abs()
    bound = half2_bound(x, w, codes, bias)
    assert (err <= bound).all(), f"worst {(err / bound).max():.3g} of the bound"
    if xs == "normal":  # the stored fp16 output: within a few fp16 ulps of the reference's
        out16 = run(x, w, bias, form="half2")
        assert not torch.isnan(out16).any(), "kernel left poisoned (NaN) outputs"
        torch.testing.assert_close(out16.double(), ref, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("M", [1, 2])
def test_qgemv_half2_exact_sums(M):
    """x = i / 8 (|i| <= 8): the fp16 sums are exact, so a wrong code, pair or x word shows
    against fp32 rounding (what the error bound's fp16 terms would hide)."""
    gen = torch.Generator().manual_seed(SEED + 23 * M)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    K, N = 256, 7
    w = make(gen, N, K, 4, 64, torch.float16)
    x = (torch.randint(-8, 9, (M, K), generator=gen) / 8).to(torch.float16)
    wd = dequantize(w, torch.float32).double()
    ref = F.linear(x.double(), wd)
    out = run(x, w, None, form="half2", out_dtype=torch.float32)
    mag = F.linear(x.double().abs(), wd.abs())
    err = (out.double() - ref).abs()
    assert (err <= 1e-6 * mag).all(), f"worst {(err / mag).max():.3g} of sum |x w|"


def test_half2_stand_ins():
    """The simulator's f16x2 stand-ins round once per operation, keep subnormals, overflow to
    inf; the half2 constants decode codes exactly."""
    from voltserve.kernels.runtime.half2 import h2_bits, h2_vals, h2f, h2fma, h2mul

    a, b = h2_bits(1.0 + 2.0**-10, -3.0), h2_bits(1.0 - 2.0**-11, 2.0**-20)
    assert h2_vals(h2fma(a, b, h2_bits(-1.0, 0.0))) == (
        2.0**-10 - 2.0**-11 - 2.0**-21,
        -3 * 2.0**-20,
    )
    assert h2_vals(h2mul(h2_bits(2.0**-14, 300.0), h2_bits(2.0**-8, 300.0))) == (
        2.0**-22,
        float("inf"),
    )
    assert h2f(h2_bits(0.5, -2.0)) == (0.5, -2.0)
    for c in range(16):
        for lo, mul, add in (
            (c, quant_gemv.H2_LO_MUL, quant_gemv.H2_LO_ADD),
            (16 * c, quant_gemv.H2_HI_MUL, quant_gemv.H2_HI_ADD),
        ):
            word = (lo | lo << 16) | quant_gemv.H2_MAGIC
            assert h2_vals(h2fma(word, mul, add)) == ((c - 8) / 256, (c - 8) / 256)


def test_host_side_rules():
    gen = torch.Generator().manual_seed(0)
    w = make(gen, 4, 64, 4, 16, torch.float32)
    assert quant_gemv.is_split(w) and not quant_gemv.is_split(
        make(gen, 4, 64, 4, 32, torch.float32)
    )
    assert not quant_gemv.supports(torch.randn(1, 64), w)  # CPU tensors
    assert quant_gemv.qgemv_kernel(3, 4) is quant_gemv.qgemv_kernel(4, 4)
    with pytest.raises(ValueError, match="M = 1..8"):
        quant_gemv.qgemv_kernel(9, 4)
    with pytest.raises(ValueError, match="R must be even"):
        quant_gemv.qgemv_kernel(1, 4, kind=quant_gemv.GATE_UP, tile=(3, 1))
    src = quant_gemv._source(1, 2, 4, 4, False, quant_gemv.PLAIN)
    assert "ld_w4(qw, (rw1, c3)) if c3 < W else ZERO_W4" in src and "bits_f32(" in src
    src = quant_gemv._source(2, 4, 1, 4, False, quant_gemv.GATE_UP)
    assert "rw3 = rw2 + N" in src and "_silu_mul(" in src and "bits_f32(" in src


# ---- qkv_rope: rotary and the KV-cache write in the epilogue ---------------------------------


@pytest.mark.parametrize("M,bits,g,dtype", [(1, 4, 32, torch.float32), (2, 8, 16, torch.float16)])
def test_qgemv_qkv_rope_matches_reference(M, bits, g, dtype):
    from voltserve.kernels.attention.rotary import build_cos_sin_cache

    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 11 * M)
    n_q, n_kv, D, K, bs, blocks = 2, 1, 8, 64, 4, 3
    N = (n_q + 2 * n_kv) * D
    w = make(gen, N, K, bits, g, dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype) if M == 2 else None
    positions = torch.randint(0, 64, (M,), generator=gen, dtype=torch.int64)
    slots = torch.randperm(blocks * bs, generator=gen)[:M].to(torch.int64)
    if M > 1:
        slots[1] = -1  # padding row: rotated into out, never written to the cache
    cache = build_cos_sin_cache(D, 64, 10000.0, None)
    k_cache = torch.randn(blocks, n_kv, bs, D, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, n_kv, bs, D, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = quant_gemv.quant_qkv_rope_ref(
        x, w, bias, positions, cache, k_ref, v_ref, slots, n_q, n_kv
    )
    out = torch.full((M, N), float("nan"), dtype=dtype)
    b = bias if bias is not None else w.scales.view(-1)
    launch(
        quant_gemv.qgemv_kernel(M, bits, False, quant_gemv.QKV_ROPE),
        N // 2,
        32,
        tuple(
            a.numpy() if isinstance(a, torch.Tensor) else a
            for a in (
                x,
                w.qweight,
                w.scales,
                w.offsets,
                b,
                out,
                bias is not None,
                w.group_shift,
                positions,
                cache,
                k_cache,
                v_cache,
                slots,
                n_q,
                n_kv,
            )
        ),
    )
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    t = dict(atol=8e-3, rtol=8e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **t)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), **t)  # only live slots written
    torch.testing.assert_close(v_cache.float(), v_ref.float(), **t)


def test_quant_qkv_rope_cpu_composition():
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.kernels.linear.quant_linear import quant_qkv_rope

    gen = torch.Generator().manual_seed(SEED)
    n_q, n_kv, D, K = 2, 1, 16, 64
    w = make(gen, (n_q + 2 * n_kv) * D, K, 4, 32, torch.float32)
    x = torch.randn(3, K, generator=gen)
    pos = torch.tensor([1, 5, 9])
    slots = torch.tensor([0, -1, 6])
    cache = build_cos_sin_cache(D, 64, 10000.0, None)
    kc, vc = torch.zeros(2, n_kv, 4, D), torch.zeros(2, n_kv, 4, D)
    kr, vr = kc.clone(), vc.clone()
    ops = KernelDispatch("cpu", torch.float32)
    y = quant_qkv_rope(x, w, None, ops, pos, cache, kc, vc, slots, n_q, n_kv)
    ref = quant_gemv.quant_qkv_rope_ref(x, w, None, pos, cache, kr, vr, slots, n_q, n_kv)
    assert torch.equal(y, ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
    assert kc.abs().sum() > 0


# ---- split-K: KS warps of a block on the same rows, each a 1/KS share of K --------------------
# Launched as on the GPU (grid_for's blocks of THREADS = 4 warps, so a KS = 2 block holds two
# groups of rows, the last block's second one past the end). The simulator's shuffle stand-in
# synchronises the whole block, which is exact while every live thread of the block reaches the
# same shuffles: true for the epilogue of KS = 1 and for warp 0 of each group after the split-K
# barrier (the other warps have left).


def run_tiled(x, w, bias, tile, kind=quant_gemv.PLAIN, form="half2", out_dtype=torch.float32):
    M = x.shape[0]
    cols = w.out_features // 2 if kind == quant_gemv.GATE_UP else w.out_features
    out = torch.full((M, cols), float("nan"), dtype=out_dtype)
    b = bias if bias is not None else w.scales[:, 0].contiguous()
    launch(
        quant_gemv.qgemv_kernel(M, w.bits, quant_gemv.is_split(w), kind, tile, form),
        quant_gemv.grid_for(M, cols, w.bits, kind, tile),
        quant_gemv.THREADS,
        tuple(
            a.numpy() if isinstance(a, torch.Tensor) else a
            for a in (x, w.qweight, w.scales, w.offsets, b, out, bias is not None, w.group_shift)
        ),
    )
    assert not torch.isnan(out).any(), f"KS = {tile[2:]}: kernel left poisoned (NaN) outputs"
    return out


# KS = 1 against KS = 2 and 4: the same products and fp16 runs (half2: one per lane chunk,
# whatever the split), only the fp32 sums regrouped (a lane's chunks in up to four shares, then
# the shares added), so the outputs agree within fp32 summation error: 2**-20 of sum |x w|
# (observed: under 2**-26).
KS_TOL = 2.0**-20


# (M, N, bits, g, K, form, (R, U)). A warp chunk (every lane one 16-byte chunk) is 1024 int4 /
# 512 int8 inputs; K = 3 * 1024 + 256 is 4 warp chunks, the last partial: KS = 2 gives 2 + 2
# (the second ends in the partial chunk), KS = 4 one each; at U = 2 every share's step is half
# guarded. 5 * 512 + 128 int8 inputs: 6 warp chunks, KS = 4 gives 2, 2, 2 (partial) and an
# empty share. K = 128: KS > 1 leaves every warp but the first without inputs.
SPLIT_K_CASES = [
    (1, 5, 4, 128, 3 * 1024 + 256, "half2", (4, 2)),
    (2, 5, 4, 32, 2 * 1024 + 256, "factored", (4, 1)),  # KS = 4: 1, 1, partial, empty
    (2, 5, 8, 32, 5 * 512 + 128, "weight", (2, 2)),
    (1, 3, 4, 16, 2 * 1024 + 512, "factored", (2, 1)),  # SPLIT groups (two a chunk)
    (1, 3, 4, 64, 128, "half2", (4, 2)),
    (3, 3, 4, 32, 1024 + 128, "half2", (4, 1)),  # the M = 4 kernel, input 3 clamped to 2
]


@pytest.mark.parametrize("M,N,bits,g,K,form,rt", SPLIT_K_CASES)
def test_qgemv_split_k(M, N, bits, g, K, form, rt):
    from voltserve.kernels.linear.quant_linear import quant_linear_ref

    gen = torch.Generator().manual_seed(SEED + 29 * M + K)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    w = make(gen, N, K, bits, g, torch.float16)
    x = torch.randn(M, K, generator=gen).to(torch.float16)
    bias = torch.randn(N, generator=gen).to(torch.float16) if M == 2 else None
    wd = dequantize(w, torch.float32).double()
    mag = F.linear(x.double().abs(), wd.abs(), None if bias is None else bias.double().abs())
    one = run_tiled(x, w, bias, (*rt, 1), form=form)
    ref = quant_linear_ref(x.float(), w, None if bias is None else bias.float()).double()
    for ks in (2, 4):
        out = run_tiled(x, w, bias, (*rt, ks), form=form)
        err = (out.double() - one.double()).abs()
        assert (err <= KS_TOL * mag).all(), f"KS = {ks}: worst {(err / mag).max():.3g} of sum |x w|"
        # Against the reference as KS = 1 is (its form's error: half2's fp16 runs, ~1e-3 here).
        assert ((out.double() - ref).abs() <= 4e-3 * mag.max()).all()
    if K > 1024 and M == 1:  # the stored fp16 output too
        out16 = run_tiled(x, w, bias, (*rt, 4), form=form, out_dtype=torch.float16)
        torch.testing.assert_close(out16.float(), ref.float().half().float(), **tol(x.dtype))


@pytest.mark.parametrize("M,form", [(1, "half2"), (2, "weight")])
def test_qgemv_gate_up_split_k(M, form):
    """gate_up with KS = 2 and 4 (R = 4: two columns a group; 3 columns, so the last group is
    half used and, at KS = 2, the second group of the second block has no column): as KS = 1
    before the epilogue's roundings, and the silu_and_mul of the reference."""
    from voltserve.kernels.linear.quant_linear import quant_gate_up_ref

    gen = torch.Generator().manual_seed(SEED + 31 * M)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    K, inter = 2 * 1024 + 256, 3
    w = make(gen, 2 * inter, K, 4, 128, torch.float16)
    x = torch.randn(M, K, generator=gen).to(torch.float16)
    bias = torch.randn(2 * inter, generator=gen).to(torch.float16) if M == 2 else None
    kind = quant_gemv.GATE_UP
    one = run_tiled(x, w, bias, (4, 1, 1), kind, form)
    ref = quant_gate_up_ref(x, w, bias).float()
    for ks in (2, 4):
        out = run_tiled(x, w, bias, (4, 1, ks), kind, form)
        # The epilogue rounds gate and up to fp16 (the stored product) before silu: a sum on a
        # rounding boundary may move one fp16 ulp there, so KS = 1 within a few fp16 ulps.
        torch.testing.assert_close(out, one, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(out, ref, atol=4e-3, rtol=4e-3)


def run_rope_tiled(x, w, tile, k_cache, v_cache, positions, slots, cache, n_q, n_kv):
    M, N = x.shape[0], w.out_features
    out = torch.full((M, N), float("nan"))
    launch(
        quant_gemv.qgemv_kernel(M, 4, False, quant_gemv.QKV_ROPE, tile, "half2"),
        quant_gemv.grid_for(M, N // 2, 4, quant_gemv.QKV_ROPE, tile),
        quant_gemv.THREADS,
        (x.numpy(), w.qweight.numpy(), w.scales.numpy(), w.offsets.numpy())
        + (w.scales.view(-1).numpy(), out.numpy(), False, w.group_shift)
        + (positions.numpy(), cache.numpy(), k_cache.numpy(), v_cache.numpy())
        + (slots.numpy(), n_q, n_kv),
    )
    assert not torch.isnan(out).any(), f"KS = {tile[2:]}: kernel left poisoned (NaN) outputs"
    return out


@pytest.mark.parametrize("M", [1, 2])
def test_qgemv_qkv_rope_split_k(M):
    """qkv_rope with KS = 2 and 4 (one rotary pair a group): out and the K / V caches as KS = 1
    writes them and as the reference (fp32 x and caches: the epilogue's roundings are exact
    no-ops, so the split's fp32 regrouping is all that differs)."""
    from voltserve.kernels.attention.rotary import build_cos_sin_cache

    gen = torch.Generator().manual_seed(SEED + 37 * M)
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    n_q, n_kv, D, K, bs, blocks = 1, 1, 4, 1024 + 256, 4, 3
    N = (n_q + 2 * n_kv) * D
    w = make(gen, N, K, 4, 128, torch.float16)
    x = torch.randn(M, K, generator=gen).to(torch.float16)
    positions = torch.randint(0, 64, (M,), generator=gen, dtype=torch.int64)
    slots = torch.randperm(blocks * bs, generator=gen)[:M].to(torch.int64)
    if M > 1:
        slots[1] = -1  # padding row: rotated into out, never written to the cache
    cache = build_cos_sin_cache(D, 64, 10000.0, None)
    k0 = torch.randn(blocks, n_kv, bs, D, generator=gen).to(torch.float16)
    v0 = torch.randn(blocks, n_kv, bs, D, generator=gen).to(torch.float16)
    k_ref, v_ref = k0.float(), v0.float()
    ref = quant_gemv.quant_qkv_rope_ref(
        x.float(), w, None, positions, cache, k_ref, v_ref, slots, n_q, n_kv
    )
    outs = []
    for ks in (1, 2, 4):
        kc, vc = k0.clone(), v0.clone()
        out = run_rope_tiled(x, w, (2, 2, ks), kc, vc, positions, slots, cache, n_q, n_kv)
        outs.append((out, kc, vc))
    for out, kc, vc in outs:
        t = dict(atol=4e-3, rtol=4e-3)  # half2's fp16 runs, then fp16 caches
        torch.testing.assert_close(out, ref, **t)
        torch.testing.assert_close(kc.float(), k_ref, **t)  # only live slots written
        torch.testing.assert_close(vc.float(), v_ref, **t)
    for out, kc, vc in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kc, outs[0][1], atol=2e-3, rtol=2e-3)  # one fp16 ulp
        torch.testing.assert_close(vc, outs[0][2], atol=2e-3, rtol=2e-3)


def test_split_k_host_rules():
    t = quant_gemv.tiling
    assert t(1, 4) == quant_gemv.SPLIT_K_M1 == (4, 1, 2)  # int4, one row: measured default
    assert t(1, 4, quant_gemv.GATE_UP) == quant_gemv.SPLIT_K_M1
    assert t(2, 4) == (*quant_gemv.tile_for(2, 4), 1)  # no split elsewhere
    assert t(1, 8) == (*quant_gemv.tile_for(1, 8), 1)
    assert t(1, 4, quant_gemv.QKV_ROPE) == (2, 2, 1)
    assert t(1, 4, tile=(2, 2)) == (2, 2, 1) and t(1, 4, tile=(2, 2, 4)) == (2, 2, 4)
    with pytest.raises(ValueError, match="KS must be one of"):
        quant_gemv.qgemv_kernel(1, 4, tile=(4, 2, 3))
    assert quant_gemv.qgemv_kernel(1, 4, tile=(4, 1, 2)) is quant_gemv.qgemv_kernel(1, 4)
    assert quant_gemv.qgemv_kernel(2, 4, tile=(4, 2, 1)) is quant_gemv.qgemv_kernel(2, 4)
    # A block: 4 warps = 4 / KS groups of R rows (gate_up R / 2 columns, qkv_rope one pair).
    assert quant_gemv.grid_for(1, 4096, 4, tile=(4, 2, 1)) == 4096 // 16
    assert quant_gemv.grid_for(1, 4096, 4, tile=(4, 2, 2)) == 4096 // 8
    assert quant_gemv.grid_for(1, 4096, 4, tile=(4, 2, 4)) == 4096 // 4
    assert quant_gemv.grid_for(1, 14336, 4, quant_gemv.GATE_UP, (4, 1, 4)) == 14336 // 2
    assert quant_gemv.grid_for(1, 3072, 4, quant_gemv.QKV_ROPE, (2, 2, 4)) == 3072
    src1 = quant_gemv._source(1, 4, 2, 4, False, quant_gemv.PLAIN, "half2")
    assert "shared" not in src1 and "syncthreads" not in src1
    src4 = quant_gemv._source(1, 4, 2, 4, False, quant_gemv.PLAIN, "half2", ks=4)
    assert "red[wb + 3, 3, lane]" in src4 and src4.count("cuda.syncthreads()") == 1
    # Everything from the half2 scaling on (the epilogue) is KS = 1's.
    assert src4[src4.index("    a0_0 *= float32(256.0)") :] == src1[src1.index("    a0_0 *=") :]
