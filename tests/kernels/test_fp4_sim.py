"""The FP4 kernels (kernels/linear/fp4_kernels.py) in the CUDA simulator. The dequantize kernel
against a torch reference written here from the published rules (not fp4_pack's): E2M1 codes
(sign bit 3; 0, 0.5, 1, 1.5, 2, 3, 4, 6), low nibble first; E4M3 scales through torch's
float8_e4m3fn; E8M0 scales as 2**(b - 127); fp4_pack.dequantize_fp4 against the same rules on
every code and scale byte. The GEMVs (the tiled kernel over its tiles, row counts, guarded tails
and rows past N, in the table form and the half2 form; the one-row-a-warp kernel) against
fp4_linear.fp4_linear_ref evaluated in float64, within the bounds of their fp32 sums (and the
half2 form's fp16 runs, fp4_kernels' module doc) and output rounding; the half2 decode's bit
moves on every code in both halves of every pair. Outputs are NaN-poisoned first; launched
with the production grids and blocks. Seeded: printed, VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.linear import fp4_kernels
from voltserve.kernels.linear.fp4_linear import fp4_dequant_grid, fp4_linear_ref
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, dequantize_fp4, make_fp4_weight
from voltserve.kernels.runtime.half2 import h2_vals, h2mul, prmt, prmt2
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


def launch_gemv(
    w, x: torch.Tensor, b, out: torch.Tensor, gate_up: bool = False, tile=None, form="table"
):
    """The tiled GEMV for x's row count (tile None: the default) in the given dot-product form
    on the production grid over out's columns."""
    launch(
        fp4_kernels.fp4_gemv_kernel(x.shape[0], gate_up, w.group_size, w.e8m0, tile, form),
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


def within_bound(out, ref, mag, dtype, extra=0.0) -> torch.Tensor:
    """|out - ref| within the fp32 allowance (mag = sum |x w| + |bias|) and `extra` (the half2
    form's, half2_allowance) plus one rounding of the output to dtype: half an ulp (2**-11 of
    |value| for fp16) or 2**-25 where it is an fp16 subnormal; fp32 outputs are the fp32
    result itself."""
    d = FP32_SUMS * mag + extra
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


def gate_up_bound(out, x, w, b, dtype, extra=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(h of the reference, the bound on |out - h|) for silu_and_mul(fp4_linear_ref): gate and
    up within the fp32 allowance of the exact sums (plus `extra` [M, 2 cols], the half2
    form's), each rounded to dtype (up to one ulp off where the kernel's sum sits across a
    rounding boundary); silu (slope <= 1.1) rounded to dtype, again up to an ulp apart; h
    rounded once by the kernel."""
    cols = out.shape[1]
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-23
    y = fp4_linear_ref(x.double(), w, None if b is None else b.double())
    yr = y.to(dtype).double()  # the stored gate and up
    gate, up = yr[:, :cols], yr[:, cols:]
    silu = (gate * torch.sigmoid(gate)).to(dtype).double()
    ref = silu * up
    d = FP32_SUMS * magnitudes(x, w, b) + extra + ulp * y.abs()
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


# ---------------------------------------------------------------------------------------------
# The half2 form (fp4_kernels.HALF2: fp16 x, fp16 runs per block half)


def _e2m1(c: int) -> float:
    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7]


def test_half2_decode_every_code_in_both_halves():
    """The bit claims of the half2 decode, exhaustively: (mag << 9) | (sign << 15) is the fp16
    pattern of the E2M1 value times 2**-14 for all 16 codes; h2_decode's statements (the
    kernel's own source, run here on Python ints) give, for each of a word's four pairs, that
    pattern of its two codes in the two halves, whatever the word's other six codes: every code
    pair in every pair position (the rest random), for both pairings (FAR: (e, e + 4), also
    against the per-pair formula ((w << (9 - 4e)) & 0x0E000E00) | ((w << (12 - 4e)) &
    0x80008000); NEAR: (2e, 2e + 1)); and the mul.f16x2 by 2**(14 - s) makes the exact values
    v * 2**-s for both block sizes."""
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    rng = random.Random(SEED)
    # the stand-in's prmt.b32: result byte i is byte (sel >> 4i) & 7 of b:a (a bytes 0-3)
    a, b = 0x03020100, 0x07060504
    assert [prmt2(a, b, sel) for sel in (0x5410, 0x7632)] == [0x05040100, 0x07060302]
    assert prmt2(0xDDCCBBAA, 0, fp4_kernels.H2_UP) == 0xCC00AA00
    for c in range(16):
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        assert h2_vals(bits)[0] == _e2m1(c) * 2.0**-14, c
    assert [fp4_kernels.h2_shift(g) for g in (16, 32)] == [6, 7]
    units = [2.0 ** -fp4_kernels.h2_shift(g) for g in (16, 32)]  # 2**-s
    for gap in (fp4_kernels.FAR, fp4_kernels.NEAR):
        lines, pairs = fp4_kernels.h2_decode("", "w", "d", gap)
        src = "\n".join(lines + [f"p = ({', '.join(pairs)},)"])
        code = compile(src, "<h2_decode>", "exec")
        codes = [(e, e + 4) if gap == fp4_kernels.FAR else (2 * e, 2 * e + 1) for e in range(4)]
        words = []
        for a, b in codes:
            for ca in range(16):
                for cb in range(16):
                    w = rng.getrandbits(32) & ~((0xF << 4 * a) | (0xF << 4 * b))
                    words.append(w | ca << 4 * a | cb << 4 * b)
        for w in words:
            scope = {"prmt": prmt, "prmt2": prmt2, "w": w}
            exec(code, scope)  # noqa: S102 - the kernel's generated decode
            for e, (a, b) in enumerate(codes):
                lo, hi = (w >> 4 * a) & 15, (w >> 4 * b) & 15
                got = scope["p"][e] & 0xFFFFFFFF
                if gap == fp4_kernels.FAR:
                    mag = (w << (9 - 4 * e)) if e < 3 else (w >> 3)
                    want = (mag & 0x0E000E00) | ((w << (12 - 4 * e)) & 0x80008000)
                    assert got == want, (hex(w), e)
                assert h2_vals(got) == (_e2m1(lo) * 2.0**-14, _e2m1(hi) * 2.0**-14), (hex(w), e)
                for unit in units:
                    mul = fp4_kernels.h2_bits(unit * 2.0**14, unit * 2.0**14)
                    want = (_e2m1(lo) * unit, _e2m1(hi) * unit)
                    assert h2_vals(h2mul(got, mul)) == want, (hex(w), e, unit)


def half2_allowance(x, w, b=None) -> torch.Tensor:
    """The half2 form's bound (fp4_kernels' module doc) per output, [M, rows], in float64: each
    half of a block is a run of n = group / 2 fp16 roundings of the products x * v * 2**-s
    (exact inputs), <= gamma_n * sum |terms| (gamma_n = n u / (1 - n u), u = 2**-11) in the
    normal range plus <= 2**-25 each where a sum is an fp16 subnormal; in output units times
    2**s |S| (S = fl(scale * gscale), the block's factor). The fp32 rest is FP32_SUMS'."""
    n, s = w.group_size // 2, fp4_kernels.h2_shift(w.group_size)
    gamma = n * 2.0**-11 / (1 - n * 2.0**-11)
    if w.scale_kind == E4M3:
        sc = w.scales.view(torch.float8_e4m3fn).float()
    else:
        sc = torch.pow(2.0, w.scales.double() - 127).float()
    S = (sc * w.gscale[:, None]).double().abs()  # fl(scale * gscale) in fp32, as the kernel
    mag = magnitudes(x, w, None) * (1 + 2.0**-20)  # |v S| vs the reference's fl(v S)
    sub = 2 * n * 2.0**-25 * (1 + gamma) * 2.0**s * S.sum(dim=1)
    return gamma * mag + sub[None, :]


# (M, scale kind, block, K, N, bias, tile): fp16 x. A warp chunk is 1024 inputs; K past a
# step's last whole chunk leaves a partial chunk, rows past N a partial group.
HALF2_CASES = [
    # (4, 1, 2): share 1 a partial chunk (lanes 0-1); rows 5-7 past N
    (1, E4M3, 16, 1088, 5, True, None),
    # (4, 2, 1): one step of 256 words over 136 (chunk 1 of lanes 0-1 only); rows 3 past N
    (1, E8M0, 32, 1088, 3, False, (4, 2, 1)),
    # (4, 2, 1): chunk 1 partial (lanes 0-2); rows 6-7 past N
    (2, E8M0, 32, 1120, 6, False, None),
    # (2, 2, 1): lanes 8-31 past K; row 3 past N
    (8, E4M3, 16, 256, 3, False, None),
]


@pytest.mark.parametrize("M,kind,group,K,N,bias,tile", HALF2_CASES)
def test_gemv_half2_matches_reference(M, kind, group, K, N, bias, tile):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 300 + 10 * M + K)
    w = make(gen, N, K, group, kind)
    x = torch.randn(M, K, generator=gen).half()
    b = torch.randn(N, generator=gen).half() if bias else None
    out = torch.full((M, N), float("nan"), dtype=torch.float16)
    launch_gemv(w, x, b, out, tile=tile, form=fp4_kernels.HALF2)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = fp4_linear_ref(x.double(), w, None if b is None else b.double())
    mag = magnitudes(x, w, b)
    ok = within_bound(out, ref, mag, torch.float16, half2_allowance(x, w))
    assert ok.all(), f"worst {(out.double() - ref).abs().max():.3g}"


# (M, scale kind, block, K, columns, bias)
HALF2_GATE_UP_CASES = [
    (1, E4M3, 16, 1088, 5, True),  # (4, 1, 2): a partial share; columns 5-7 past the end
    (2, E4M3, 16, 96, 3, False),  # (4, 1, 1): lanes 3-31 past K; column 3 past the end
    (8, E8M0, 32, 96, 3, True),  # (2, 2, 1): one column a group; group 3 past the end
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("M,kind,group,K,cols,bias", HALF2_GATE_UP_CASES)
def test_gemv_half2_gate_up_matches_linear_then_silu_and_mul(M, kind, group, K, cols, bias):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 400 + M)
    w = make(gen, 2 * cols, K, group, kind)
    x = (torch.randn(M, K, generator=gen) / 16).half()  # as the table form's gate_up test
    b = torch.randn(2 * cols, generator=gen).half() if bias else None
    out = torch.full((M, cols), float("nan"), dtype=torch.float16)
    launch_gemv(w, x, b, out, gate_up=True, form=fp4_kernels.HALF2)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref, bound = gate_up_bound(out, x, w, b, torch.float16, half2_allowance(x, w))
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("kind,group", [(E4M3, 16), (E8M0, 32)])
def test_gemv_half2_runs_do_not_overflow_at_the_largest_x(kind, group):
    """The range argument: every x at 65504 (fp16's largest) against codes of 6 of one sign
    puts each fp16 run at its largest, 0.75 * 65504 with the 2**-s units; the result is finite
    and within the bound (small block scales keep the output itself in fp16's range)."""
    K, N = 64, 2
    packed = torch.full((N, K // 2), 0x77, dtype=torch.uint8)  # every code +6
    packed[1] = 0xFF  # every code -6
    if kind == E4M3:
        scales, gscale = torch.full((N, K // group), 0x01, dtype=torch.uint8), torch.ones(N)
    else:
        scales, gscale = torch.full((N, K // group), 100, dtype=torch.uint8), torch.ones(N)
    w = make_fp4_weight(packed, scales, gscale * 0.5, group, kind)
    x = torch.full((1, K), 65504.0).half()
    out = torch.full((1, N), float("nan"), dtype=torch.float16)
    launch_gemv(w, x, None, out, form=fp4_kernels.HALF2)
    assert torch.isfinite(out).all(), out
    ref = fp4_linear_ref(x.double(), w)
    ok = within_bound(out, ref, magnitudes(x, w, None), torch.float16, half2_allowance(x, w))
    assert ok.all(), (out, ref)


def test_form_for_defaults_and_force():
    """fp16 x takes the half2 form at every row count, fp32 x the table form; a forced form
    is taken for fp16 x, refused by name when unknown, and fp32 x keeps the table form."""
    form_for, TABLE, HALF2 = fp4_kernels.form_for, fp4_kernels.TABLE, fp4_kernels.HALF2
    assert [form_for(m, torch.float16) for m in (1, 2, 3, 8)] == [HALF2] * 4
    assert [form_for(m, torch.float32) for m in (1, 8)] == [TABLE] * 2
    assert form_for(1, torch.float16, TABLE) == TABLE
    assert form_for(1, torch.float32, HALF2) == TABLE
    with pytest.raises(ValueError):
        form_for(1, torch.float16, "fp32")
    with pytest.raises(ValueError):
        fp4_kernels.fp4_gemv_kernel(1, form="fp32")
