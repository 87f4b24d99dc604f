"""On a CUDA GPU: the fused group-quantized MoE decode kernels (kernels/moe/quant_decode.py)
against their torch reference (moe_experts_ref on the dequantized experts) at Qwen3-30B-A3B
shapes (hidden 2048, 128 experts, top-8, expert intermediate 768): int4 group 128 (AWQ / GPTQ),
int4 group 16 (the SPLIT variant: GGUF Q2_K/Q3_K) and int8 group 32 (GGUF Q8_0), for 1, 4 and 8
tokens, routings where half the experts receive no token and where one expert receives every
token; NaN-poisoned allocator blocks; the launches captured in a CUDA graph; and the tiny AWQ
Qwen3-MoE through the runner with the fused kernels counted. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.linear.quant_pack import pack_group_quant
from voltserve.kernels.moe import quant_decode as mq

from tests.gpu import moe_decode_checks as mc
from tests.gpu.moe_decode_checks import INTER, ROUTINGS, E, H

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CODES = {"int4-g128": (4, 128), "int4-g16": (4, 16), "int8-g32": (8, 32)}


_WEIGHTS: dict = {}


def _packed(rows: int, K: int, bits: int, g: int, gen) -> object:
    codes = torch.randint(0, 2**bits, (rows, K), device="cuda", generator=gen, dtype=torch.uint8)
    s = (torch.rand(rows, K // g, device="cuda", generator=gen) + 0.5) * (2.0 / (K**0.5 * 2**bits))
    o = -s * 2 ** (bits - 1) + torch.randn(rows, K // g, device="cuda", generator=gen) * 0.01
    return pack_group_quant(codes, s, o, bits, g, torch.float16)


def _weights(codes: str):
    """Flat stacked experts (w13 [E * 2I, H], w2 [E * H, I]) of one code type at a time."""
    if codes not in _WEIGHTS:
        _WEIGHTS.clear()
        bits, g = CODES[codes]
        gen = torch.Generator(device="cuda").manual_seed(1234)
        _WEIGHTS[codes] = (
            _packed(E * 2 * INTER, H, bits, g, gen),
            _packed(E * H, INTER, bits, g, gen),
        )
    return _WEIGHTS[codes]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T", [1, 4, 8, 64, 128])  # past 8: batched decode while fused_pays
@pytest.mark.parametrize("codes", list(CODES))
def test_fused_quant_experts_match_reference(codes: str, T: int, routing: str) -> None:
    if codes != "int4-g128" and (routing != "random" or T > 8):
        pytest.skip("the other code types on random routing at decode sizes only (time)")
    w13, w2 = _weights(codes)
    mc.check_matches_reference(
        mq, mq.moe_quant_decode, mq.moe_quant_experts_ref, w13, w2, T, routing
    )


@pytest.mark.parametrize("T", [1, 8])
def test_fused_quant_experts_are_graph_capturable(T: int) -> None:
    w13, w2 = _weights("int4-g128")
    mc.check_graph_capturable(mq.moe_quant_decode, w13, w2, T)


def test_runner_decodes_awq_experts_through_the_fused_kernels(monkeypatch) -> None:
    """The tiny AWQ Qwen3-MoE (fp32, eager) runs its decode steps on the fused kernels, and its
    greedy tokens equal the same runner's with the dequantizing pair path (the fused kernels
    turned away by their `supports`; every other op as before)."""
    from tests import quant_checkpoints as qc

    path, _ = qc.awq_checkpoint("qwen3_moe", 32)
    mc.check_runner_uses_fused_kernels(
        monkeypatch, mq, "moe_quant_decode", path, max_tokens=mq.MAX_TOKENS
    )


def test_dense_all_kernel_equals_the_reference_dequantize() -> None:
    """The batched path's dequantize of every expert (quant/experts.py dense_all) through
    kernels/linear/quant_dequant, in row slabs (the stacked experts pass the grid's row limit),
    equals the torch reference bit for bit."""
    from dataclasses import replace

    from voltserve.kernels.linear.quant_pack import dequantize
    from voltserve.services.executor.quant import experts as qe

    w13, _ = _weights("int4-g128")  # flat [E * 2I, H]
    assert w13.out_features > 65535
    out = qe._dequantize(w13, kernel=True)
    ref = dequantize(replace(w13, perm=None))
    assert out.shape == ref.shape and not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
