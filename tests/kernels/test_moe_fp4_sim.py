"""The fused FP4 MoE decode kernels (kernels/moe/fp4_decode.py) in the CUDA simulator against
moe_experts_ref on the experts dequantized by the published rules (test_fp4_sim.ref_weight, not
fp4_pack's), rounded to the run dtype: NVFP4 (E4M3 scale per 16, a global scale per row) and
MXFP4 (E8M0 per 32), k = 2, two and three tokens, an expert that receives every token and one that
receives none, the intermediate h and the output NaN-poisoned, the production grids (one case
with the pairs and tokens folded over y and z). Also the launch geometry of the production
launcher at Qwen3-30B-A3B's shape (recorded, not run). Seeded (tests/conftest.py rng)."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, make_fp4_weight
from voltserve.kernels.moe import fp4_decode as mf
from voltserve.kernels.moe.experts import moe_experts_ref
from voltserve.kernels.runtime.numba_common import SIM, launch

from tests.kernels.test_fp4_sim import ref_weight
from tests.kernels.test_moe_sim import _routing

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


def _flat(gen, rows, K, kind, group):
    """A flat stacked FP4 weight [E * N, K]: random codes, finite scale bytes around 2**-3 .. 2
    (E4M3 with some subnormals and zeros), NVFP4 global scales per row as a merged gate_up's
    shards have them."""
    packed = torch.randint(0, 256, (rows, K // 2), generator=gen, dtype=torch.uint8)
    n = rows * (K // group)
    if kind == E4M3:
        b = torch.randint(0x20, 0x40, (n,), generator=gen)
        b[: n // 8] = torch.randint(0, 8, (n // 8,), generator=gen)  # subnormals, zero
        b |= torch.randint(0, 2, (n,), generator=gen) << 7  # negative scales too
        gscale = torch.rand(rows, generator=gen) * 0.5 + 0.25
    else:
        b = torch.randint(123, 128, (n,), generator=gen)
        gscale = torch.ones(rows)
    scales = b.to(torch.uint8).view(rows, K // group)
    return make_fp4_weight(packed, scales, gscale, group, kind)


def _run(x, w13, w2, wts, ids, limit):
    """fp4_decode's two launches with host arrays, h and out poisoned."""
    T, H = x.shape
    k, inter = ids.shape[1], w2.in_features
    h = torch.full((T * k, inter), float("nan"), dtype=x.dtype)
    out = torch.full((T, H), float("nan"), dtype=x.dtype)
    for kernel, g, args in (
        (mf.fp4_moe_gate_up_kernel, mf.grid(inter, T * k, limit), (x, w13, ids, h)),
        (mf.fp4_moe_down_kernel, mf.grid(H, T, limit), (h, w2, ids, wts.float(), out)),
    ):
        a, w, *rest = args
        arrays = (a, w.packed.view(torch.int32), w.scales, w.gscale, *rest)
        launch(kernel, g, mf.THREADS, (*(t.numpy() for t in arrays), w.group_shift, w.e8m0))
    return h, out


# (T, kind, group, dtype, fold limit); H = 32, I = one block: gate_up rows of two NVFP4 blocks
# (one MXFP4), down rows of one. Few, small cases: every simulated lane is a thread that meets
# the others at each shuffle, and a warp owns one column of one pair (gate_up) or one row of
# one token (down).
CASES = [
    (3, E4M3, 16, torch.float16, None),
    # 4 pairs folded over y and z at a limit of 3: idle blocks past the count
    (2, E8M0, 32, torch.float32, 3),
]


@sim_only
@pytest.mark.parametrize("T,kind,group,dtype,limit", CASES)
def test_fused_fp4_experts_match_the_reference(rng, T, kind, group, dtype, limit):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    E, k, H, inter = 3, 2, 32, group
    w13 = _flat(gen, E * 2 * inter, H, kind, group)
    w2 = _flat(gen, E * H, inter, kind, group)
    x = torch.randn(T, H, generator=gen).to(dtype)
    wts, ids = _routing(gen, T, E, k, all_to=1, skip=2)
    h, out = _run(x, w13, w2, wts, ids, limit)
    assert not torch.isnan(h.float()).any(), "gate_up left poisoned (NaN) outputs"
    assert not torch.isnan(out.float()).any(), "down left poisoned (NaN) outputs"

    def dense(w, n, kk):
        return ref_weight(w.packed, w.scales, w.gscale, group, kind).to(dtype).view(E, n, kk)

    d13, d2 = dense(w13, 2 * inter, H), dense(w2, H, inter)
    # the kernels decode in fp32, the reference rounds each weight to the dtype first
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    pairs = ids.reshape(-1).long()
    y = torch.bmm(d13[pairs].float(), x.float().repeat_interleave(k, 0).unsqueeze(-1))
    want_h = silu_and_mul_ref(y.squeeze(-1).to(dtype))
    assert (h.float() - want_h.float()).abs().max() <= tol * want_h.float().abs().max()
    ref = moe_experts_ref(x, d13, d2, wts, ids)
    assert ref.abs().max() > 0
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    # the launcher's own reference is the same meaning (fp4_pack's dequantization)
    assert torch.equal(mf.moe_fp4_experts_ref(x, w13, w2, wts, ids), ref)


def test_launch_geometry_at_qwen3_30b_a3b_shape():
    """The production launcher at Qwen3-30B-A3B's experts (128 experts, H 2048, I 768, top-8;
    NVFP4 and MXFP4) on meta tensors, recorded: every launch within the device limits, the
    arguments in the kernels' order, and the batches the fused kernels take."""
    from voltserve.kernels.runtime.launch_geometry import MAX_GRID_YZ, recording

    E, H, inter, k = 128, 2048, 768, 8
    for kind, group in ((E4M3, 16), (E8M0, 32)):

        def flat(n, kk, kind=kind, group=group):
            return mf.Fp4Weight(
                torch.empty(E * n, kk // 2, dtype=torch.uint8, device="meta"),
                torch.empty(E * n, kk // group, dtype=torch.uint8, device="meta"),
                torch.empty(E * n, device="meta"),
                group,
                kind,
            )

        w13, w2 = flat(2 * inter, H), flat(H, inter)
        for T in (1, 8, 128):
            x = torch.empty(T, H, dtype=torch.float16, device="meta")
            wts = torch.empty(T, k, device="meta")
            ids = torch.empty(T, k, dtype=torch.int32, device="meta")
            with recording() as launches:
                assert mf.supports(x, w13, w2, k)
                out = mf.moe_fp4_decode(x, w13, w2, wts, ids)
            assert out.shape == (T, H)
            gate_up, down = launches
            assert gate_up.kernel == "moe.fp4_decode.fp4_moe_gate_up_kernel"
            assert down.kernel == "moe.fp4_decode.fp4_moe_down_kernel"
            # one warp per column of every pair (gate_up) / row of every token (down)
            assert gate_up.grid == (inter // mf.WARPS, T * k, 1)
            assert down.grid == (H // mf.WARPS, T, 1)
            assert gate_up.block == down.block == (mf.THREADS, 1, 1)
            assert gate_up.arg("packed").shape == (E * 2 * inter, H // 8)
            assert gate_up.arg("scales").shape == (E * 2 * inter, H // group)
            assert gate_up.arg("out").shape == (T * k, inter)
            assert down.arg("h").shape == (T * k, inter)
            assert down.arg("packed").shape == (E * H, inter // 8)
            assert down.arg("wts").dtype == "float32" and down.arg("ids").dtype == "int32"
            assert down.arg("e8m0").value == (kind == E8M0)
            assert down.arg("gshift").value == group.bit_length() - 1
        # past what pays (T * k > 8 E) the caller dequantizes instead
        x = torch.empty(129, H, dtype=torch.float16, device="meta")
        with recording():
            assert not mf.supports(x, w13, w2, k)
    # the fold keeps any count of pairs within gridDim.y
    assert mf.grid(inter, 3 * MAX_GRID_YZ + 1) == (inter // mf.WARPS, MAX_GRID_YZ, 4)
