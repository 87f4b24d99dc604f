"""The FP4 kernels (kernels/linear/fp4_kernels.py) in the CUDA simulator against a torch reference
written here from the published rules (not fp4_pack's): E2M1 codes (sign bit 3; 0, 0.5, 1, 1.5,
2, 3, 4, 6), low nibble first; E4M3 scales through torch's float8_e4m3fn; E8M0 scales as
2**(b - 127). Outputs are NaN-poisoned first; launched with the production grids and blocks.
Seeded: printed, VOLTSERVE_TEST_SEED overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.linear import fp4_kernels
from voltserve.kernels.linear.fp4_linear import fp4_dequant_grid
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, make_fp4_weight
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


def launch_gemv(w, x: torch.Tensor, b, out: torch.Tensor, gate_up: bool = False) -> None:
    """The GEMV kernel of x's row count on the production grid over out's columns; b None:
    without bias."""
    launch(
        fp4_kernels.fp4_gemv_kernel(x.shape[0], gate_up=gate_up),
        fp4_kernels.gemv_grid(out.shape[1]),
        fp4_kernels.THREADS,
        (
            x.numpy(),
            w.packed.view(torch.int32).numpy(),
            w.scales.numpy(),
            w.gscale.numpy(),
            (out[0] if b is None else b).numpy(),
            out.numpy(),
            b is not None,
            w.group_shift,
            w.e8m0,
        ),
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


@pytest.mark.parametrize(
    "M,kind,group,K,dtype,bias",
    [
        (1, E4M3, 16, 1024, torch.float16, True),  # two steps of a warp (512 inputs each)
        (3, E8M0, 32, 96, torch.float32, False),  # the 4-row variant with 3 rows, lanes idle
        (8, E4M3, 16, 64, torch.float16, False),
    ],
)
def test_gemv_kernel_matches_reference(M, kind, group, K, dtype, bias):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + M)
    N = 6  # two blocks of 4 warps, the last two rows past N
    w = make(gen, N, K, group, kind)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_gemv(w, x, b, out)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    wd = ref_weight(w.packed, w.scales, w.gscale, group, kind).double()
    ref = x.double() @ wd.T + (b.double() if bias else 0)
    # fp32 sums regrouped (per 16-input block, then per lane), one rounding to the dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    scale = (x.double().abs() @ wd.abs().T).max()
    assert (out.double() - ref).abs().max() <= tol * scale


@pytest.mark.parametrize("M,dtype,bias", [(1, torch.float16, True), (8, torch.float32, False)])
def test_gemv_gate_up_kernel_matches_linear_then_silu_and_mul(M, dtype, bias):
    """The merged gate_up weight [2I, K]: h = silu(gate) * up, each product rounded to the
    storage dtype first as the unfused path stores it."""
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat)")
    gen = torch.Generator().manual_seed(SEED + 100 + M)
    Cols, K = 5, 64  # 5 output columns: two blocks of 4 warps, three past the end
    w = make(gen, 2 * Cols, K, 16, E4M3)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(2 * Cols, generator=gen).to(dtype) if bias else None
    out = torch.full((M, Cols), float("nan"), dtype=dtype)
    launch_gemv(w, x, b, out, gate_up=True)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    wd = ref_weight(w.packed, w.scales, w.gscale, 16, E4M3).double()
    y = (x.double() @ wd.T + (b.double() if bias else 0)).to(dtype).double()
    gate, up = y[:, :Cols], y[:, Cols:]
    ref = (gate * torch.sigmoid(gate)).to(dtype).double() * up
    # gate and up: fp32 sums regrouped (1e-6 of the sum of |terms|), then a rounding to the
    # dtype that may go to the neighbouring value (ulp); each moves h by the slope; h itself
    # rounds once more
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-23
    terms = x.double().abs() @ wd.abs().T
    dg = 1e-6 * terms[:, :Cols] + ulp * gate.abs()
    du = 1e-6 * terms[:, Cols:] + ulp * up.abs()
    silu = gate * torch.sigmoid(gate)
    bound = 1.1 * dg * up.abs() + silu.abs() * du + ulp * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("kind,group", [(E4M3, 16), (E8M0, 32)])
def test_torch_reference_matches_the_published_rules(kind, group):
    """fp4_pack.dequantize_fp4 (the CPU path and the kernels' fallback) on every code and scale
    byte."""
    from voltserve.kernels.linear.fp4_pack import dequantize_fp4

    gen = torch.Generator().manual_seed(SEED)
    w = make(gen, 8, 32 * group, group, kind, every=True)
    want = ref_weight(w.packed, w.scales, w.gscale, group, kind)
    assert torch.equal(dequantize_fp4(w), want)
