"""On a CUDA GPU: the fused FP4 MoE decode kernels (kernels/moe/fp4_decode.py) against their
torch reference (moe_experts_ref on the dequantized experts) at Qwen3-30B-A3B shapes (hidden
2048, 128 experts, top-8, expert intermediate 768), NVFP4 and MXFP4, for 1, 8 and 64 tokens,
routings where half the experts receive no token and where one expert receives every token;
NaN-poisoned allocator blocks; the launches captured in a CUDA graph; the batched path's
dequantize of every expert (past gridDim.y's row limit) bit for bit; and the tiny NVFP4
Qwen3-MoE through the runner with the fused kernels counted. Skipped without CUDA."""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, dequantize_fp4, make_fp4_weight
from voltserve.kernels.moe import fp4_decode as mf
from voltserve.kernels.moe.routing import moe_topk_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, E, K_TOP, INTER = 2048, 128, 8, 768
KINDS = {"nvfp4": (E4M3, 16), "mxfp4": (E8M0, 32)}
ROUTINGS = ("random", "half_idle", "one_hot_expert")


def _seed() -> int:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return seed


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
@pytest.mark.parametrize("T", [1, 8, 64])  # past 8: batched decode while fused_pays
@pytest.mark.parametrize("fmt", list(KINDS))
def test_fused_fp4_experts_match_reference(fmt: str, T: int, routing: str) -> None:
    if fmt != "nvfp4" and routing != "random":
        pytest.skip("MXFP4 on random routing only (time)")
    w13, w2 = _weights(fmt)
    g = torch.Generator(device="cuda").manual_seed(_seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = _routing(routing, T, g)
    if routing == "half_idle":
        assert int(ids.max()) < E // 2
    if routing == "one_hot_expert":
        assert bool((ids == 3).any(dim=1).all())
    assert mf.supports(x, w13, w2, K_TOP)
    _poison_pool(T * K_TOP * INTER * 2 + T * H * 2)
    out = mf.moe_fp4_decode(x, w13, w2, wts, ids)
    torch.cuda.synchronize()
    ref = mf.moe_fp4_experts_ref(x, w13, w2, wts, ids)
    assert out.dtype == torch.float16 and out.shape == (T, H)
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element)"
    assert ref.abs().max() > 0
    # the kernels decode in fp32, the reference rounds each weight to fp16 first
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("T", [1, 8])
def test_fused_fp4_experts_are_graph_capturable(T: int) -> None:
    w13, w2 = _weights("nvfp4")
    g = torch.Generator(device="cuda").manual_seed(_seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = _routing("random", T, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mf.moe_fp4_decode(x, w13, w2, wts, ids)  # compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mf.moe_fp4_decode(x, w13, w2, wts, ids)
    x.copy_(torch.randn(T, H, device="cuda", generator=g).half())
    new_wts, new_ids = _routing("random", T, g)
    wts.copy_(new_wts)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, mf.moe_fp4_decode(x, w13, w2, wts, ids), atol=0, rtol=0)


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
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.request import Request
    from voltserve.shared.config import EngineConfig
    from voltserve.shared.sampling_params import SamplingParams

    from tests import fp4_checkpoints as fc
    from tests.checkpoints import drive

    path, _ = fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4")
    calls = []
    real = mf.moe_fp4_decode

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(mf, "moe_fp4_decode", counted)

    def run(dequantizing: bool):
        if dequantizing:
            monkeypatch.setattr(mf, "supports", lambda *a, **kw: False)
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
    assert calls and max(calls) <= 8, calls
    calls.clear()
    assert run(True) == fused
    assert not calls
