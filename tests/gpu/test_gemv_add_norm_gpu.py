"""The GEMV with the residual add + RMSNorm as its last block's epilogue (kernels/gemv.py,
add_norm) on a GPU: the same bits as the two launches it replaces (the plain GEMV, then
fused_add_rms_norm) at Llama-3-8B's o_proj and down_proj shapes and Qwen2.5-0.5B's, eager and
inside a CUDA graph replayed three times with poisoned outputs, the arrival counter back at
zero; and a tiny model's decode with the fusion on and off (VOLTSERVE_GEMV_NORM=0) giving the
same tokens and log-probabilities."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import ARCHS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
EPS = 1e-5
# (K, N): Llama-3-8B o_proj and down_proj; Qwen2.5-0.5B o_proj and down_proj (N = 896: a
# partial warp of chunks in the tail).
SHAPES = [(4096, 4096), (14336, 4096), (896, 896), (4864, 896)]


def _inputs(M, K, N, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g).half()
    w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).half()
    residual = torch.randn(M, N, device=DEV, generator=g).half()
    weight = (1 + 0.1 * torch.randn(N, device=DEV, generator=g)).half()
    return x, w, residual, weight


def _unfused(x, w, residual, weight):
    from voltserve.kernels.gemv import gemv_cuda
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_cuda

    res = residual.clone()
    y = gemv_cuda(x, w)
    fused_add_rms_norm_cuda(y, res, weight, EPS)
    return y, res


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 8])
def test_same_bits_as_the_two_launches(K, N, M):
    from voltserve.kernels.gemv import gemv_add_rms_norm_cuda, gemv_add_rms_norm_ref

    x, w, residual, weight = _inputs(M, K, N, seed=1000 * M + N)
    want_y, want_res = _unfused(x, w, residual, weight)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):  # the second launch runs only if the first reset the counter
        res = residual.clone()
        y = gemv_add_rms_norm_cuda(x, w, None, res, weight, EPS, counter)
        torch.cuda.synchronize()
        assert torch.equal(y, want_y)
        assert torch.equal(res, want_res)
        assert counter.item() == 0
    ref_res = residual.clone()
    ref_y = gemv_add_rms_norm_ref(x.float(), w.float(), None, ref_res.float(), weight.float(), EPS)
    torch.testing.assert_close(y.float(), ref_y, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 2])
def test_in_a_cuda_graph(K, N, M):
    from voltserve.kernels.gemv import gemv_add_rms_norm_cuda

    x, w, residual, weight = _inputs(M, K, N, seed=7 * M + K)
    want_y, want_res = _unfused(x, w, residual, weight)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    res = residual.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_add_rms_norm_cuda(x, w, None, res, weight, EPS, counter)  # compile, warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_add_rms_norm_cuda(x, w, None, res, weight, EPS, counter)
    for _ in range(3):
        res.copy_(residual)
        y.fill_(float("nan"))  # poisoned: every element written by the replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want_y)
        assert torch.equal(res, want_res)
        assert counter.item() == 0


def _decode(arch: str, monkeypatch, fused: bool):
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.shared.config import EngineConfig
    from voltserve.shared.sampling_params import SamplingParams

    from tests.checkpoints import checkpoint, drive
    from tests.gpu.test_cuda_graph_decode import _requests

    monkeypatch.setenv("VOLTSERVE_GEMV_NORM", "1" if fused else "0")
    cfg = EngineConfig(
        model=str(checkpoint(arch)),
        dtype="float16",
        device="cuda",
        num_kv_blocks=128,
        max_model_len=256,
        max_graph_batch_size=16,
        enforce_eager=False,
    )
    runner = ModelRunner(cfg)
    assert runner.ops.impl["gemv_add_rms_norm"] == ("cuda" if fused else "ref")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    reqs = _requests(5, 2, params)  # batch 2, then 1: the GEMV rows of the default plan
    drive(runner, reqs, 12, chunk=32)
    return reqs


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_same_with_and_without_the_fusion(arch: str, monkeypatch) -> None:
    a = _decode(arch, monkeypatch, fused=True)
    b = _decode(arch, monkeypatch, fused=False)
    for ra, rb in zip(a, b, strict=True):
        assert ra.output_token_ids == rb.output_token_ids
        for ta, tb in zip(ra.trace, rb.trace, strict=True):
            assert ta.logprob == tb.logprob  # the same bits through every layer
