"""Checks shared by the fused MoE decode kernel GPU tests (FP4 and group-quantized): each kernel
family passes its decode function, its reference and its weights; the shapes are Qwen3-30B-A3B's
(hidden 2048, 128 experts, top-8, expert intermediate 768)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from types import ModuleType

import torch
from voltserve.kernels.moe.routing import moe_topk_ref

H, E, K_TOP, INTER = 2048, 128, 8, 768
ROUTINGS = ("random", "half_idle", "one_hot_expert")

Decode = Callable[..., torch.Tensor]


def seed() -> int:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return seed


def routing(kind: str, T: int, g: torch.Generator):
    logits = torch.randn(T, E, device="cuda", generator=g)
    if kind == "half_idle":
        logits[:, E // 2 :] = -1e4
    elif kind == "one_hot_expert":
        logits[:, 3] += 100.0
    return moe_topk_ref(logits.half(), K_TOP, True, torch.float16)


def poison_pool(nbytes: int) -> None:
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del junk


def check_matches_reference(
    kernels: ModuleType, decode: Decode, reference: Decode, w13, w2, T: int, kind: str
) -> None:
    """`decode` on NaN-poisoned allocator blocks equals `reference` for T tokens routed `kind`."""
    g = torch.Generator(device="cuda").manual_seed(seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = routing(kind, T, g)
    if kind == "half_idle":
        assert int(ids.max()) < E // 2
    if kind == "one_hot_expert":
        assert bool((ids == 3).any(dim=1).all())
    assert kernels.supports(x, w13, w2, K_TOP)
    poison_pool(T * K_TOP * INTER * 2 + T * H * 2)
    out = decode(x, w13, w2, wts, ids)
    torch.cuda.synchronize()
    ref = reference(x, w13, w2, wts, ids)
    assert out.dtype == torch.float16 and out.shape == (T, H)
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element)"
    assert ref.abs().max() > 0
    # the kernels decode in fp32, the reference rounds each weight to fp16 first
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def check_graph_capturable(decode: Decode, w13, w2, T: int) -> None:
    """`decode` captured in a CUDA graph and replayed on new inputs equals an eager call."""
    g = torch.Generator(device="cuda").manual_seed(seed())
    x = torch.randn(T, H, device="cuda", generator=g).half()
    wts, ids = routing("random", T, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode(x, w13, w2, wts, ids)  # compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(x, w13, w2, wts, ids)
    x.copy_(torch.randn(T, H, device="cuda", generator=g).half())
    new_wts, new_ids = routing("random", T, g)
    wts.copy_(new_wts)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, decode(x, w13, w2, wts, ids), atol=0, rtol=0)


def check_runner_uses_fused_kernels(
    monkeypatch, kernels: ModuleType, decode_name: str, path, max_tokens: int
) -> None:
    """The tiny MoE checkpoint at `path` (fp32, eager) runs its decode steps on
    `kernels.<decode_name>`, at most `max_tokens` rows a call, and its greedy tokens equal the
    same runner's with the fused kernels turned away by their `supports`."""
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.request import Request
    from voltserve.shared.config import EngineConfig
    from voltserve.shared.sampling_params import SamplingParams

    from tests.checkpoints import drive

    calls = []
    real = getattr(kernels, decode_name)

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(kernels, decode_name, counted)

    def run(dequantizing: bool):
        if dequantizing:
            monkeypatch.setattr(kernels, "supports", lambda *a, **kw: False)
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
    assert calls and max(calls) <= max_tokens, calls
    calls.clear()
    assert run(True) == fused
    assert not calls
