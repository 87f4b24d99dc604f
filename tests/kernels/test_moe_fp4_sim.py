"""The fused FP4 MoE decode kernels (kernels/moe/fp4_decode.py) in the CUDA simulator against
moe_experts_ref on the experts dequantized by the published rules (test_fp4_sim.ref_weight, not
fp4_pack's), rounded to the run dtype: NVFP4 (E4M3 scale per 16, a global scale per row) and
MXFP4 (E8M0 per 32), k = 2, two tokens, an expert that receives every token and one that
receives none, the intermediate h and the output NaN-poisoned, the production grids (one case
with the pairs folded over y and z). The production launcher's geometry at model shapes is in
test_launch_geometry.py. Seeded (tests/conftest.py rng)."""

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

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


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
    (2, E4M3, 16, torch.float16, None),
    # 4 pairs folded over y and z at a limit of 3: idle blocks past the count
    (2, E8M0, 32, torch.float32, 3),
]


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
