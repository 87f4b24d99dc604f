"""On a CUDA GPU: the fused FP4 MoE decode kernels (kernels/moe/fp4_decode.py) against their
torch reference (moe_experts_ref on the dequantized experts) at Qwen3-30B-A3B shapes (hidden
2048, 128 experts, top-8, expert intermediate 768), NVFP4 and MXFP4, for 1, 8 and 64 tokens,
routings where half the experts receive no token and where one expert receives every token;
NaN-poisoned allocator blocks; the launches captured in a CUDA graph; the batched path's
dequantize of every expert (past gridDim.y's row limit) bit for bit; and the tiny NVFP4
Qwen3-MoE through the runner with the fused kernels counted. Skipped without CUDA."""

from __future__ import annotations

import functools

import pytest
import torch
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, dequantize_fp4, make_fp4_weight
from voltserve.kernels.moe import fp4_decode as mf

from tests.gpu import moe_decode_checks as mc
from tests.gpu.moe_decode_checks import INTER, ROUTINGS, E, H

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KINDS = {"nvfp4": (E4M3, 16), "mxfp4": (E8M0, 32)}


def _flat(rows: int, K: int, kind: str, g: int, gen):
    """A flat stacked FP4 weight [E * N, K] with weights ~ +-0.03 (fp16 sums stay small): E4M3
    block scales 0x18..0x27 times a global 2**-6 (a per-row global scale, as merged shards
    have), or E8M0 2**-9 .. 2**-7."""
    packed = torch.randint(0, 256, (rows, K // 2), generator=gen, device="cuda", dtype=torch.uint8)
    lo, hi = (0x18, 0x28) if kind == E4M3 else (118, 121)
    scales = torch.randint(lo, hi, (rows, K // g), generator=gen, device="cuda", dtype=torch.uint8)
    if kind == E4M3:
        gscale = 2.0**-6 * (1 + torch.rand(rows, generator=gen, device="cuda"))
    else:
        gscale = torch.ones(rows, device="cuda")
    return make_fp4_weight(packed, scales, gscale, g, kind)


@functools.cache
def _weights(name: str):
    """Flat stacked experts (w13 [E * 2I, H], w2 [E * H, I]) of one format."""
    kind, g = KINDS[name]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    return _flat(E * 2 * INTER, H, kind, g, gen), _flat(E * H, INTER, kind, g, gen)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T", [1, 8, 64])  # past 8: batched decode while fused_pays
@pytest.mark.parametrize("fmt", list(KINDS))
def test_fused_fp4_experts_match_reference(fmt: str, T: int, routing: str) -> None:
    if fmt != "nvfp4" and routing != "random":
        pytest.skip("MXFP4 on random routing only (time)")
    w13, w2 = _weights(fmt)
    mc.check_matches_reference(mf, mf.moe_fp4_decode, mf.moe_fp4_experts_ref, w13, w2, T, routing)


@pytest.mark.parametrize("T", [1, 8])
def test_fused_fp4_experts_are_graph_capturable(T: int) -> None:
    w13, w2 = _weights("nvfp4")
    mc.check_graph_capturable(mf.moe_fp4_decode, w13, w2, T)


@pytest.mark.parametrize("fmt", list(KINDS))
def test_batched_path_dequantize_equals_the_reference(fmt: str) -> None:
    """The batched path's dequantize of every expert (Fp4Experts.dense through the FP4 dequantize
    kernel, rows folded over y and z: E * 2I passes gridDim.y's 65,535) equals fp4_pack's
    reference bit for bit."""
    from voltserve.kernels import dispatch

    w13, _ = _weights(fmt)
    assert w13.out_features > 65535
    out = dispatch.fp4_dequantize(w13, torch.float16, kernel=True)
    ref = dequantize_fp4(w13, torch.float16)
    assert out.shape == ref.shape and not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_runner_decodes_fp4_experts_through_the_fused_kernels(monkeypatch) -> None:
    """The tiny NVFP4 Qwen3-MoE (fp32, eager) runs its decode steps on the fused kernels, and its
    greedy tokens equal the same runner's with every expert dequantized per call (the fused
    kernels turned away by their `supports`; every other op as before)."""
    from tests import fp4_checkpoints as fc

    path, _ = fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4")
    mc.check_runner_uses_fused_kernels(monkeypatch, mf, "moe_fp4_decode", path, max_tokens=8)
