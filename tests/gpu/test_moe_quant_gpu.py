"""On a CUDA GPU: the fused group-quantized MoE decode kernels (kernels/moe/quant_decode.py)
against their torch reference (moe_experts_ref on the dequantized experts) at Qwen3-30B-A3B
shapes (hidden 2048, 128 experts, top-8, expert intermediate 768): int4 group 128 (AWQ / GPTQ),
int4 group 16 (the SPLIT variant: GGUF Q2_K/Q3_K) and int8 group 32 (GGUF Q8_0), for 1, 4 and 8
tokens, routings where half the experts receive no token and where one expert receives every
token; NaN-poisoned allocator blocks; the launches captured in a CUDA graph; and the tiny AWQ
Qwen3-MoE through the runner with the fused kernels counted. Skipped without CUDA."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.linear.quant_pack import pack_group_quant
from voltserve.kernels.moe import quant_decode as mq
from voltserve.kernels.moe.routing import moe_topk_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, E, K_TOP, INTER = 2048, 128, 8, 768
CODES = {"int4-g128": (4, 128), "int4-g16": (4, 16), "int8-g32": (8, 32)}
ROUTINGS = ("random", "half_idle", "one_hot_expert")


def _seed() -> int:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return seed


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


def _routing(kind: str, T: int, g):
    logits = torch.randn(T, E, device="cuda", generator=g)
    if kind == "half_idle":
        logits[:, E // 2 :] = -1e4
    elif kind == "one_hot_expert":
        logits[:, 3] += 100.0
    return moe_topk_ref(logits.half(), K_TOP, True, torch.float16)


def _poison_pool(nbytes: int) -> None:
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del junk


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T", [1, 4, 8, 64, 128])  # past 8: batched decode while fused_pays
@pytest.mark.parametrize("codes", list(CODES))
def test_fused_quant_experts_match_reference(codes: str, T: int, routing: str) -> None:
    if codes != "int4-g128" and (routing != "random" or T > 8):
        pytest.skip("the other code types on random routing at decode sizes only (time)")
    w13, w2 = _weights(codes)
    g = torch.Generator(device="cuda").manual_seed(_seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = _routing(routing, T, g)
    if routing == "half_idle":
        assert int(ids.max()) < E // 2
    if routing == "one_hot_expert":
        assert bool((ids == 3).any(dim=1).all())
    assert mq.supports(x, w13, w2, K_TOP)
    _poison_pool(T * K_TOP * INTER * 2 + T * H * 2)
    out = mq.moe_quant_decode(x, w13, w2, wts, ids)
    torch.cuda.synchronize()
    ref = mq.moe_quant_experts_ref(x, w13, w2, wts, ids)
    assert out.dtype == torch.float16 and out.shape == (T, H)
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element)"
    assert ref.abs().max() > 0
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("T", [1, 8])
def test_fused_quant_experts_are_graph_capturable(T: int) -> None:
    w13, w2 = _weights("int4-g128")
    g = torch.Generator(device="cuda").manual_seed(_seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = _routing("random", T, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mq.moe_quant_decode(x, w13, w2, wts, ids)  # compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mq.moe_quant_decode(x, w13, w2, wts, ids)
    x.copy_(torch.randn(T, H, device="cuda", generator=g).half())
    new_wts, new_ids = _routing("random", T, g)
    wts.copy_(new_wts)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, mq.moe_quant_decode(x, w13, w2, wts, ids), atol=0, rtol=0)


def test_runner_decodes_awq_experts_through_the_fused_kernels(monkeypatch) -> None:
    """The tiny AWQ Qwen3-MoE (fp32, eager) runs its decode steps on the fused kernels, and its
    greedy tokens equal the same runner's with the dequantizing pair path (the fused kernels
    turned away by their `supports`; every other op as before)."""
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.request import Request
    from voltserve.shared.config import EngineConfig
    from voltserve.shared.sampling_params import SamplingParams

    from tests import quant_checkpoints as qc
    from tests.checkpoints import drive

    path, _ = qc.awq_checkpoint("qwen3_moe", 32)
    calls = []
    real = mq.moe_quant_decode

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(mq, "moe_quant_decode", counted)

    def run(dequantizing: bool):
        if dequantizing:
            monkeypatch.setattr(mq, "supports", lambda *a, **kw: False)
        cfg = EngineConfig(
            model=str(path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=64,
            max_model_len=256,
            enforce_eager=True,
        )
        runner = ModelRunner(cfg)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        rng = random.Random(5)
        reqs = [
            Request(
                f"r{i}",
                [rng.randrange(300) for _ in range(9 + i)],
                params,
                seed=i,
                arrival_time=0.0,
            )
            for i in range(3)
        ]
        drive(runner, reqs, 8, chunk=32)
        return [r.output_token_ids for r in reqs]

    fused = run(False)
    assert calls and max(calls) <= mq.MAX_TOKENS, calls
    calls.clear()
    assert run(True) == fused
    assert not calls


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
