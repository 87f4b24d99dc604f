"""The FP4 kernels (kernels/linear/fp4_kernels.py) in the CUDA simulator. The dequantize kernel
against a torch reference written here from the published rules (not fp4_pack's): E2M1 codes
(sign bit 3; 0, 0.5, 1, 1.5, 2, 3, 4, 6), low nibble first; E4M3 scales through torch's
float8_e4m3fn; E8M0 scales as 2**(b - 127); fp4_pack.dequantize_fp4 against the same rules on
every code and scale byte. The GEMVs (the tiled kernel over its tiles, row counts, guarded tails
and rows past N; the one-row-a-warp kernel) against fp4_linear.fp4_linear_ref evaluated in
float64, within the bounds of their fp32 sums and output rounding. Outputs are NaN-poisoned
first; launched with the production grids and blocks. Seeded: printed, VOLTSERVE_TEST_SEED
overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.linear import fp4_kernels
from voltserve.kernels.linear.fp4_linear import fp4_dequant_grid, fp4_linear_ref
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, dequantize_fp4, make_fp4_weight
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_weight(packed, scales, gscale, group, kind) -> torch.Tensor:
    """fp32 [N, K]: e2m1(code) * (scale * gscale[row]), from the published rules."""
    N = packed.shape[0]
    codes = torch.empty(N, packed.shape[1] * 2, dtype=torch.long)
    codes[:, 0::2] = (packed & 0xF).long()
    codes[:, 1::2] = (packed >> 4).long()
    vals = torch.tensor(E2M1)[codes & 7] * (1 - 2 * ((codes >> 3) & 1)).float()
    if kind == E4M3:
        s = scales.view(torch.float8_e4m3fn).float()
    else:
        s = torch.pow(2.0, scales.double() - 127).float()
    return vals * (s * gscale[:, None]).repeat_interleave(group, dim=1)


def scale_bytes(gen, shape, kind, every: bool) -> torch.Tensor:
    """Random finite scale bytes; every: each finite byte value at least once (shape allowing)."""
    n = shape[0] * shape[1]
    ok = [
        b for b in range(256) if (kind == E4M3 and b & 0x7F != 0x7F) or (kind == E8M0 and b < 255)
    ]
    if every:
        assert n >= len(ok)
        picks = torch.tensor(ok * (n // len(ok) + 1))[:n]
        picks = picks[torch.randperm(n, generator=gen)]
    else:
        # E4M3 around 1 and in the subnormal range; E8M0 within a few octaves of 1
        lo, hi = (0x20, 0x48) if kind == E4M3 else (120, 134)
        picks = torch.randint(lo, hi, (n,), generator=gen)
        picks[: n // 8] = torch.randint(0, 8, (n // 8,), generator=gen)  # subnormals, zero
    return picks.to(torch.uint8).view(shape)


def make(gen, N, K, group, kind, every=False):
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    scales = scale_bytes(gen, (N, K // group), kind, every)
    gscale = torch.rand(N, generator=gen) * 0.5 + 0.25 if kind == E4M3 else torch.ones(N)
    return make_fp4_weight(packed, scales, gscale, group, kind)


def gemv_args(w, x: torch.Tensor, b, out: torch.Tensor) -> tuple:
    """Both GEMVs' leading arguments; b None: without bias (any 1-D array of the dtype)."""
    bias = out[0] if b is None else b
    codes = w.packed.view(torch.int32)
    arrays = (x, codes, w.scales, w.gscale, bias, out)
    return (*(a.numpy() for a in arrays), b is not None)


def launch_gemv(w, x: torch.Tensor, b, out: torch.Tensor, gate_up: bool = False, tile=None):
    """The tiled GEMV for x's row count (tile None: the default) on the production grid over
    out's columns."""
    launch(
        fp4_kernels.fp4_gemv_kernel(x.shape[0], gate_up, w.group_size, w.e8m0, tile),
        fp4_kernels.grid_for(x.shape[0], out.shape[1], gate_up, tile),
        fp4_kernels.THREADS,
        gemv_args(w, x, b, out),
    )


def launch_gemv_v1(w, x: torch.Tensor, b, out: torch.Tensor, gate_up: bool = False) -> None:
    """fp4_gemv_v1_kernel, as launch_gemv (it takes the block shift and scale kind too)."""
    launch(
        fp4_kernels.fp4_gemv_v1_kernel(x.shape[0], gate_up),
        fp4_kernels.v1_grid(out.shape[1]),
        fp4_kernels.THREADS,
        (*gemv_args(w, x, b, out), w.group_shift, w.e8m0),
    )


# E8M0 byte 254 (2**127) times 6 overflows fp32 to inf, in the kernel as in the reference
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "kind,group,N,K,dtype,limit",
    [
        (E4M3, 16, 8, 512, torch.float32, None),  # every E4M3 byte (256 blocks, NaN excepted)
        (E8M0, 32, 8, 1024, torch.float32, None),  # every E8M0 byte, 2**-127 .. 2**127
        (E4M3, 16, 5, 64, torch.float16, 2),  # rows folded over y and z, one idle
        (E8M0, 32, 3, 96, torch.float16, None),  # a partial block of threads along the row
    ],
)
def test_dequant_kernel_matches_reference(kind, group, N, K, dtype, limit):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + K)
    w = make(gen, N, K, group, kind, every=dtype == torch.float32)
    out = torch.full((N, K), float("nan"), dtype=dtype)
    launch(
        fp4_kernels.fp4_dequant_kernel,
        fp4_dequant_grid(w, limit),
        fp4_kernels.THREADS,
        (
            w.packed.view(torch.int32).numpy(),
            w.scales.numpy(),
            w.gscale.numpy(),
            out.numpy(),
            w.group_shift,
            w.e8m0,
        ),
    )
    ref = ref_weight(w.packed, w.scales, w.gscale, group, kind)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # the same fp32 products, rounded once to the output dtype
    assert torch.equal(out, ref.to(dtype))


# The kernel's fp32 arithmetic against the exact sum with the reference's fp32 weights, relative
# to sum |x w| + |bias|: a block's sum of <= 32 products (exact for fp16 x; for fp32 x each
# rounded once in its FMA) is <= 32 roundings, its multiply by the block's scale one, the
# reference's weight fl(e2m1 * scale) one, a lane's accumulator <= 4 (K <= 1120: <= 2 chunks
# of <= 2 blocks), the warp shuffles 5, the split-K adds <= 3, the bias 1: < 64 roundings of
# 2**-24, doubled for margin.
FP32_SUMS = 2.0**-17


def within_bound(out, ref, mag, dtype) -> torch.Tensor:
    """|out - ref| within the fp32 allowance (mag = sum |x w| + |bias|) plus one rounding of
    the output to dtype: half an ulp (2**-11 of |value| for fp16) or 2**-25 where it is an
    fp16 subnormal; fp32 outputs are the fp32 result itself."""
    d = FP32_SUMS * mag
    if dtype == torch.float16:
        d = d * (1 + 2.0**-11) + 2.0**-11 * ref.abs() + 2.0**-25
    return (out.double() - ref).abs() <= d


def magnitudes(x, w, b) -> torch.Tensor:
    """sum_k |x_k w_k| (+ |bias|) per output, in float64."""
    m = x.double().abs() @ dequantize_fp4(w).double().abs().T
    return m + (b.double().abs() if b is not None else 0)


# (M, scale kind, block, K, N, dtype, bias, tile; None: the default of the row count). A warp
# chunk is 1024 inputs (every lane 32); a block of 4 warps holds 4 / KS groups of R rows, so N
# below a block's rows leaves rows past N in a live group and whole groups past it.
GEMV_CASES = [
    # (4, 1, 2): share 0 one warp chunk, share 1 a partial one (8 words, lanes 0-1); rows 5-7
    (1, E4M3, 16, 1088, 5, torch.float16, True, None),
    # (4, 1, 4): shares of one chunk: full, partial, empty, empty
    (1, E8M0, 16, 1088, 5, torch.float32, True, (4, 1, 4)),
    # (4, 2, 1): one step, chunk 1 partial (140 words: lanes 0-2)
    (2, E8M0, 32, 1120, 6, torch.float32, False, None),
    # R = 2 with U = 2 and KS = 2; E4M3 scales per 32
    (2, E4M3, 32, 1088, 5, torch.float16, True, (2, 2, 2)),
    # the 4-row kernel (4, 1, 1) with 3 rows (row 3 read as row 2, not written); lanes 16-31
    # past K; rows 3-15 past N
    (3, E4M3, 16, 512, 3, torch.float32, True, None),
    # the 8-row kernel (2, 2, 1) with 5 rows; lanes 3-31 past K; row 7 past N
    (5, E8M0, 32, 96, 7, torch.float16, True, None),
    (8, E4M3, 16, 256, 3, torch.float16, False, None),
]


@pytest.mark.parametrize("M,kind,group,K,N,dtype,bias,tile", GEMV_CASES)
def test_gemv_kernel_matches_reference(M, kind, group, K, N, dtype, bias, tile):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 10 * M + K)
    w = make(gen, N, K, group, kind)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_gemv(w, x, b, out, tile=tile)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    # fp4_linear_ref in float64: the fp32 weights of dequantize_fp4, summed exactly
    ref = fp4_linear_ref(x.double(), w, None if b is None else b.double())
    ok = within_bound(out, ref, magnitudes(x, w, b), dtype)
    assert ok.all(), f"worst {(out.double() - ref).abs().max():.3g}"


def gate_up_bound(out, x, w, b, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h of the reference, the bound on |out - h|) for silu_and_mul(fp4_linear_ref): gate and
    up within the fp32 allowance of the exact sums, each rounded to dtype (up to one ulp off
    where the kernel's sum sits across a rounding boundary); silu (slope <= 1.1) rounded to
    dtype, again up to an ulp apart; h rounded once by the kernel."""
    cols = out.shape[1]
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-23
    y = fp4_linear_ref(x.double(), w, None if b is None else b.double())
    yr = y.to(dtype).double()  # the stored gate and up
    gate, up = yr[:, :cols], yr[:, cols:]
    silu = (gate * torch.sigmoid(gate)).to(dtype).double()
    ref = silu * up
    d = FP32_SUMS * magnitudes(x, w, b) + ulp * y.abs()
    dg, du = d[:, :cols], d[:, cols:]
    bound = (1.1 * dg + ulp * silu.abs()) * up.abs() + silu.abs() * (1 + ulp) * du
    return ref, bound + ulp * ref.abs() + 2.0**-24


# (M, scale kind, block, K, columns, dtype, bias, tile)
GATE_UP_CASES = [
    # (4, 1, 2): 2 columns a group, 4 a block; columns 5-7 past the end; a partial share
    (1, E4M3, 16, 1088, 5, torch.float16, True, None),
    # (2, 2, 1): one column a group; group 3 past the end; lanes 3-31 past K
    (8, E8M0, 32, 96, 3, torch.float32, False, None),
    # (4, 1, 4) for the 4-row kernel with 3 rows: shares full, partial, empty, empty
    (3, E4M3, 16, 1088, 3, torch.float16, True, (4, 1, 4)),
]


# silu of a gate below about -88: exp(-gate) overflows fp32 to inf, as on the GPU (h = -0)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("M,kind,group,K,cols,dtype,bias,tile", GATE_UP_CASES)
def test_gemv_gate_up_kernel_matches_linear_then_silu_and_mul(
    M, kind, group, K, cols, dtype, bias, tile
):
    """The merged gate_up weight [2I, K]: h = silu(gate) * up, each product rounded to the
    storage dtype first as the unfused path stores it."""
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 100 + M)
    w = make(gen, 2 * cols, K, group, kind)
    # x / 16: gate sums within the range of the simulator's math.exp in silu (Python floats:
    # it raises past 709, where the GPU's exp gives inf) with E8M0 scales up to 2**6
    x = (torch.randn(M, K, generator=gen) / 16).to(dtype)
    b = torch.randn(2 * cols, generator=gen).to(dtype) if bias else None
    out = torch.full((M, cols), float("nan"), dtype=dtype)
    launch_gemv(w, x, b, out, gate_up=True, tile=tile)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref, bound = gate_up_bound(out, x, w, b, dtype)
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("gate_up", [False, True])
def test_gemv_v1_kernel_matches_reference(gate_up):
    """The one-row-a-warp kernel (bench_quant_linear's comparison): the 4-row variant with 3
    rows, MXFP4, fp32 (plain); one fp16 row with bias, NVFP4 (gate_up)."""
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 200 + gate_up)
    M, kind, group, dtype = (
        (1, E4M3, 16, torch.float16) if gate_up else (3, E8M0, 32, torch.float32)
    )
    cols, K = 5, 96
    rows = 2 * cols if gate_up else cols
    w = make(gen, rows, K, group, kind)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if gate_up else None
    out = torch.full((M, cols), float("nan"), dtype=dtype)
    launch_gemv_v1(w, x, b, out, gate_up)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    if gate_up:
        ref, bound = gate_up_bound(out, x, w, b, dtype)
        assert ((out.double() - ref).abs() <= bound).all()
    else:
        ref = fp4_linear_ref(x.double(), w)
        assert within_bound(out, ref, magnitudes(x, w, b), dtype).all()


def test_tiling_defaults_and_checks():
    """The default tiles (split-K at one row) and the grid they give; tiles that cannot work
    are refused."""
    tiling, grid_for = fp4_kernels.tiling, fp4_kernels.grid_for
    assert tiling(1) == tiling(1, True) == (4, 1, 2)
    assert [tiling(m) for m in (2, 3, 5)] == [(4, 2, 1), (4, 1, 1), (2, 2, 1)]
    assert tiling(2, True) == (4, 1, 1) and tiling(8, True) == (2, 2, 1)
    assert tiling(1, tile=(2, 2)) == (2, 2, 1)
    assert grid_for(1, 4096) == 4096 // 8 and grid_for(1, 14336, True) == 14336 // 4
    assert grid_for(8, 4096) == 4096 // 8 and grid_for(1, 9, tile=(4, 2, 4)) == 3
    # KS not in 1, 2, 4; gate_up with an odd R; 8 rows x R = 8 outputs past the 32 lanes
    for m, gate_up, bad in ((1, False, (4, 1, 3)), (1, True, (3, 1)), (8, False, (8, 1))):
        with pytest.raises(ValueError):
            tiling(m, gate_up, bad)


@pytest.mark.parametrize("kind,group", [(E4M3, 16), (E8M0, 32)])
def test_torch_reference_matches_the_published_rules(kind, group):
    """fp4_pack.dequantize_fp4 (the CPU path and the kernels' fallback) on every code and scale
    byte."""
    from voltserve.kernels.linear.fp4_pack import dequantize_fp4

    gen = torch.Generator().manual_seed(SEED)
    w = make(gen, 8, 32 * group, group, kind, every=True)
    want = ref_weight(w.packed, w.scales, w.gscale, group, kind)
    assert torch.equal(dequantize_fp4(w), want)
