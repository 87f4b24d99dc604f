"""On a CUDA GPU: the MoE expert kernels (fused decode for <= 8 tokens, grouped GEMMs beyond)
against their torch reference at Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, expert
intermediate 768) and Mixtral-8x7B shapes (hidden 4096, 8 experts, top-2, intermediate 14336; one
layer's experts), for 1, 8, 64, 256 and 8192 tokens, with routings where half the experts
receive no token and where one expert receives every token; the whole path captured in a CUDA
graph (no host sync); and the tiny MoE checkpoints' greedy output against transformers on the
same GPU. Skipped without CUDA."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.moe.experts import WMMA_ENV, moe_experts_cuda, moe_experts_ref, supports
from voltserve.kernels.moe.routing import moe_topk_cuda, moe_topk_ref
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import MOE_ARCHS, checkpoint, drive, hf_greedy, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name -> (hidden, experts, top_k, expert intermediate, renormalise)
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 8, 768, True),
    "mixtral-8x7b": (4096, 8, 2, 14336, True),
}
TOKENS = (1, 8, 64, 256, 8192)
ROUTINGS = ("random", "half_idle", "one_hot_expert")


def _seed() -> int:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return seed


_WEIGHTS: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _weights(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    key = (shape, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # one shape's experts at a time (Mixtral's are 2.8 GB in fp16)
        H, E, _, inter, _ = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(1234)
        w13 = torch.randn(E, 2 * inter, H, device="cuda", generator=g).mul_(H**-0.5).to(dtype)
        w2 = torch.randn(E, H, inter, device="cuda", generator=g).mul_(inter**-0.5).to(dtype)
        _WEIGHTS[key] = (w13, w2)
    return _WEIGHTS[key]


def _routing(kind: str, T: int, E: int, k: int, renorm: bool, dtype, g):
    logits = torch.randn(T, E, device="cuda", generator=g)
    if kind == "half_idle":
        logits[:, E // 2 :] = -1e4  # experts E/2.. never chosen (k <= E/2)
    elif kind == "one_hot_expert":
        logits[:, 3] += 100.0  # expert 3 is in every token's top-k
    return moe_topk_ref(logits.to(dtype), k, renorm, dtype)


def _poison_pool(nbytes: int) -> None:
    """Fill freed allocator blocks with NaN so outputs a kernel leaves unwritten show up (torch's
    caching allocator hands the same blocks to the next allocations of those sizes)."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del junk


@pytest.mark.parametrize("grouped", ["simt", "wmma"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_moe_experts_kernel_matches_reference(shape, T, routing, dtype, grouped, monkeypatch):
    """grouped: which grouped GEMMs serve T > 8 (the SIMT default or the tensor-core opt-in)."""
    if dtype == torch.float32 and (T > 256 or routing != "random"):
        pytest.skip("fp32 at the decode and batched sizes only (time)")
    if grouped == "wmma" and (dtype != torch.float16 or T <= 8):
        pytest.skip("the tensor-core grouped GEMMs take fp16 and more than 8 tokens")
    monkeypatch.setenv(WMMA_ENV, "1" if grouped == "wmma" else "0")
    H, E, k, inter, renorm = SHAPES[shape]
    w13, w2 = _weights(shape, dtype)
    g = torch.Generator(device="cuda").manual_seed(_seed())
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    wts, ids = _routing(routing, T, E, k, renorm, dtype, g)
    if routing == "half_idle":
        assert int(ids.max()) < E // 2
    if routing == "one_hot_expert":
        assert bool((ids == 3).any(dim=1).all())
    assert supports(x, w13, w2)
    _poison_pool(T * k * H * 4 + T * k * inter * 2)
    out = moe_experts_cuda(x, w13, w2, wts, ids)
    torch.cuda.synchronize()
    ref = moe_experts_ref(x, w13, w2, wts, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element)"
    tol = 1e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# The router top-k per family: (experts, top_k, renormalise, weights in the activation dtype).
ROUTERS = {
    "qwen3-moe": (128, 8, True, True),
    "qwen2-moe": (60, 4, False, True),
    "mixtral": (8, 2, True, False),
}


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("family", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_topk_kernel_matches_torch_topk(T, family, dtype) -> None:
    from tests.moe_topk_cases import router_logits, topk_by_rule, weight_tolerance

    E, k, renorm, in_dtype = ROUTERS[family]
    wd = dtype if in_dtype else torch.float32
    rounded = wd != torch.float32
    tol = weight_tolerance(rounded)
    seed = _seed()
    # Logits whose top-k the logits alone decide (ties, -inf, huge values; see
    # tests/moe_topk_cases.py): the ids exactly, ties to the lowest expert index.
    logits = router_logits(torch.Generator().manual_seed(seed), T, E, dtype).cuda()
    _poison_pool(T * k * 8)
    w, ids = moe_topk_cuda(logits, k, renorm, wd)
    rw, _ = moe_topk_ref(logits, k, renorm, wd)
    assert torch.equal(ids, topk_by_rule(logits, k))
    assert not torch.isnan(w).any(), "NaN weights (an unwritten element)"
    torch.testing.assert_close(w, rw, **tol)
    # Router-like logits: near-ties may be ordered either way (the kernel's exp and sum round
    # differently from torch's softmax), so slot by slot the chosen probabilities agree with the
    # reference's, as do the weights.
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(dtype)
    w, ids = moe_topk_cuda(logits, k, renorm, wd)
    rw, rids = moe_topk_ref(logits, k, renorm, wd)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, rids.long()))
    torch.testing.assert_close(w, rw, **tol)


@pytest.mark.parametrize("T", [1, 256, 8192])
def test_topk_kernel_in_a_cuda_graph(T) -> None:
    """The launch is capturable (no host sync, grid fixed by T) and replays on new logits."""
    g = torch.Generator(device="cuda").manual_seed(_seed())
    logits = torch.randn(T, 128, device="cuda", generator=g).half()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_topk_cuda(logits, 8, True, torch.float16)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = moe_topk_cuda(logits, 8, True, torch.float16)
    logits.copy_(torch.randn(T, 128, device="cuda", generator=g).half())
    graph.replay()
    torch.cuda.synchronize()
    w2, ids2 = moe_topk_cuda(logits, 8, True, torch.float16)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


@pytest.mark.parametrize("grouped", ["simt", "wmma"])
@pytest.mark.parametrize("T", [1, 5, 8, 16, 64])
def test_moe_path_is_graph_capturable(T, grouped, monkeypatch) -> None:
    """Router top-k + experts captured in a CUDA graph (capture fails on a host sync), then
    replayed on new inputs written into the captured buffers."""
    if grouped == "wmma" and T <= 8:
        pytest.skip("T <= 8 runs the decode kernels")
    monkeypatch.setenv(WMMA_ENV, "1" if grouped == "wmma" else "0")
    H, E, k, inter, renorm = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights("qwen3-30b-a3b", torch.float16)
    g = torch.Generator(device="cuda").manual_seed(_seed())
    router = torch.randn(E, H, device="cuda", generator=g).mul_(H**-0.5).half()
    x = torch.randn(T, H, device="cuda", generator=g).half()

    def step():
        wts, ids = moe_topk_cuda(torch.nn.functional.linear(x, router), k, renorm, torch.float16)
        return moe_experts_cuda(x, w13, w2, wts, ids)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles the kernels, warms cuBLAS
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(T, H, device="cuda", generator=g).half())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(), atol=0, rtol=0)


def _requests(seed: int, n: int, params: SamplingParams) -> list[Request]:
    rng = random.Random(seed)
    V = len(tokenizer())
    return [
        Request(
            f"r{i}",
            [rng.randrange(V) for _ in range(rng.randint(1, 60))],
            params,
            seed=i,
            arrival_time=0.0,
        )
        for i in range(n)
    ]


def _runner(arch: str, dtype: str, eager: bool) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=str(checkpoint(arch)),
            dtype=dtype,
            device="cuda",
            num_kv_blocks=128,
            max_model_len=256,
            max_graph_batch_size=16,
            enforce_eager=eager,
        )
    )


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gpu_greedy_equals_transformers_on_gpu(arch: str) -> None:
    runner = _runner(arch, "float32", eager=False)
    assert runner.graphs is not None, f"no graphs captured: {runner.ops.impl}"
    assert runner.ops.impl["moe_experts"] == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    # 10 requests: decode steps of 10 (graph 16: the grouped kernels) and prefill chunks of
    # more than 8 tokens (grouped), then fewer rows (the decode kernels).
    reqs = _requests(2, 10, params)
    drive(runner, reqs, 10, chunk=24)
    for r in reqs:
        want, logits = hf_greedy(checkpoint(arch), r.prompt_token_ids, 10, device="cuda")
        assert r.output_token_ids == want
        lp = torch.log_softmax(logits, -1)
        for step, tok in enumerate(r.trace):
            assert abs(tok.logprob - lp[step, tok.token_id].item()) < 1e-3


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_graph_decode_equals_eager_fp16(arch: str) -> None:
    graph = _runner(arch, "float16", eager=False)
    eager = _runner(arch, "float16", eager=True)
    assert graph.graphs is not None, f"no graphs captured: {graph.ops.impl}"
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    a, b = _requests(1, 11, params), _requests(1, 11, params)
    before = graph.graphs.num_replays
    drive(graph, a, 12, chunk=32)
    assert graph.graphs.num_replays > before
    drive(eager, b, 12, chunk=32)
    for ra, rb in zip(a, b):
        assert ra.output_token_ids == rb.output_token_ids
        for ta, tb in zip(ra.trace, rb.trace):
            assert abs(ta.logprob - tb.logprob) < 2e-2


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_start_up_compile_phase_covers_the_moe_kernels(dtype: str) -> None:
    """The compile phase (services/executor/kernel_warmup.py) traces the MoE kernels (routing
    top-k, the fused decode pair at graph sizes <= 8, the grouped pair beyond and in the
    prefill profile), so graph capture compiles nothing."""
    from voltserve.services.executor import kernel_warmup

    runner = _runner("qwen3_moe", dtype, eager=False)
    assert runner.graphs is not None and runner.compile_report is not None
    assert runner.compiled_in_capture == [], runner.compiled_in_capture
    traced = {d.py_func.__qualname__ for d, _ in kernel_warmup.trace(runner, 16)}
    want = {
        "moe_topk_kernel",
        "moe_decode_gate_up_kernel",
        "moe_decode_down_kernel",
        "moe_grouped_gate_up_kernel",
        "moe_grouped_down_kernel",
    }
    assert want <= traced, sorted(traced)


@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-4b-act-sym"])
def test_quantized_experts_greedy_equal_transformers_on_gpu(fmt: str) -> None:
    """int4 experts (services/executor/quant/experts.py: dequantize, then the float expert
    kernels or, for fewer pairs than experts, batched matmuls; no host sync) in CUDA graphs,
    fp32, against transformers on the dequantized reference weights on the same GPU."""
    from tests import quant_checkpoints as qc

    path, ref = {
        "awq-g32": lambda: qc.awq_checkpoint("qwen3_moe", 32),
        "gptq-4b-act-sym": lambda: qc.gptq_checkpoint("qwen3_moe", 4, 32, desc_act=True, sym=True),
    }[fmt]()
    runner = ModelRunner(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=128,
            max_model_len=256,
            max_graph_batch_size=16,
        )
    )
    assert runner.graphs is not None, f"no graphs captured: {runner.ops.impl}"
    assert runner.compiled_in_capture == [], runner.compiled_in_capture
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    # 10 rows (every expert dequantized once), then one alone (3 pairs < 8 experts: one
    # dequantized expert per pair)
    reqs = _requests(2, 10, params)
    drive(runner, reqs, 8, chunk=24)
    single = _requests(3, 1, params)
    drive(runner, single, 8, chunk=24)
    for r in reqs + single:
        want, logits = hf_greedy(ref, r.prompt_token_ids, 8, device="cuda")
        assert r.output_token_ids == want
        lp = torch.log_softmax(logits, -1)
        for step, tok in enumerate(r.trace):
            assert abs(tok.logprob - lp[step, tok.token_id].item()) < 1e-3
