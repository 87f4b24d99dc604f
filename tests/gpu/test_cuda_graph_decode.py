"""On a CUDA GPU: decode steps replayed as CUDA graphs give what eager decode gives, and the GPU
runner's greedy output equals transformers' greedy output on the same GPU (fp32), for each tiny
checkpoint. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import ARCHS, checkpoint, drive, hf_greedy, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _requests(seed: int, n: int, params: SamplingParams) -> list[Request]:
    rng = random.Random(seed)
    V = len(tokenizer())
    lengths = [rng.randint(1, 60) for _ in range(n)]
    return [
        Request(f"r{i}", [rng.randrange(V) for _ in range(k)], params, seed=i, arrival_time=0.0)
        for i, k in enumerate(lengths)
    ]


def _runner(arch: str, dtype: str, eager: bool) -> ModelRunner:
    cfg = EngineConfig(
        model=str(checkpoint(arch)),
        dtype=dtype,
        device="cuda",
        num_kv_blocks=128,
        max_model_len=256,
        max_graph_batch_size=16,
        enforce_eager=eager,
    )
    return ModelRunner(cfg)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_graph_decode_equals_eager_decode(arch: str, dtype: str) -> None:
    graph = _runner(arch, dtype, eager=False)
    eager = _runner(arch, dtype, eager=True)
    assert eager.graphs is None
    assert graph.graphs is not None, f"no graphs captured: {graph.ops.impl}"
    # 5 requests: decode batches of 5 (padded to 8), then fewer as prompts differ in length.
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    a, b = _requests(1, 5, params), _requests(1, 5, params)
    before = graph.graphs.num_replays
    drive(graph, a, 12, chunk=32)
    assert graph.graphs.num_replays > before
    drive(eager, b, 12, chunk=32)
    tol = 2e-2 if dtype == "float16" else 1e-4
    for ra, rb in zip(a, b):
        assert ra.output_token_ids == rb.output_token_ids
        for ta, tb in zip(ra.trace, rb.trace):
            assert abs(ta.logprob - tb.logprob) < tol


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_greedy_equals_transformers_on_gpu(arch: str) -> None:
    runner = _runner(arch, "float32", eager=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    reqs = _requests(2, 3, params)
    drive(runner, reqs, 10, chunk=24)
    for r in reqs:
        want, logits = hf_greedy(checkpoint(arch), r.prompt_token_ids, 10, device="cuda")
        assert r.output_token_ids == want
        lp = torch.log_softmax(logits, -1)
        for step, tok in enumerate(r.trace):
            assert abs(tok.logprob - lp[step, tok.token_id].item()) < 1e-3


def test_fp16_runner_tracks_fp32_transformers() -> None:
    """fp16 (the SM70 default) stays close to the fp32 reference on the first sampled token."""
    runner = _runner("qwen2", "auto", eager=False)
    assert runner.dtype == torch.float16
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    reqs = _requests(3, 4, params)
    drive(runner, reqs, 1, chunk=64)
    for r in reqs:
        _, logits = hf_greedy(checkpoint("qwen2"), r.prompt_token_ids, 1, device="cuda")
        lp = torch.log_softmax(logits[0], -1)
        for t, v in r.trace[0].top_logprobs:
            assert abs(v - lp[t].item()) < 5e-2


@pytest.mark.parametrize("pipeline", ["0", "1"], ids=["plain", "pipelined"])
@pytest.mark.parametrize("arch", ARCHS)
def test_plain_greedy_graph_path_equals_eager(arch: str, pipeline: str, monkeypatch) -> None:
    """Greedy without logprobs takes the graph's own argmax (no sampler launch); with the
    pipelined decode (VOLTSERVE_PIPELINE_DECODE, on by default) each step is launched before the
    previous one's ids are back (and discarded when the batch changes). Both must give the eager
    runner's tokens."""
    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", pipeline)
    graph = _runner(arch, "float16", eager=False)
    assert (graph.pipeline is not None) == (pipeline == "1")
    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "0")
    eager = _runner(arch, "float16", eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a, b = _requests(3, 6, params), _requests(3, 6, params)
    before = graph.graphs.num_replays
    drive(graph, a, 16, chunk=32)
    assert graph.graphs.num_replays > before
    drive(eager, b, 16, chunk=32)
    for ra, rb in zip(a, b):
        assert ra.output_token_ids == rb.output_token_ids
    if graph.pipeline is not None:
        assert graph.pipeline.used > 0


def test_staging_upload_columns_moves_the_head_and_the_table_columns() -> None:
    """Staging.upload_columns on the GPU (the driver's 2-D copy): the bytes before the table
    and columns [0, cols) of its first rows arrive; every other device byte keeps what it
    held (poisoned before the copy)."""
    from voltserve.services.executor.graph_set import Staging, _cuda_memcpy_2d

    assert _cuda_memcpy_2d() is not None  # the copy under test, not the full-upload fallback
    rows, width = 48, 1000
    st = Staging([("pos", torch.int64, (rows,)), ("tables", torch.int32, (rows, width))], "cuda")
    rng = torch.Generator().manual_seed(0)
    st.host["pos"][:] = torch.randint(0, 1 << 40, (rows,), generator=rng).numpy()
    st.host["tables"][:] = torch.randint(1, 1 << 30, (rows, width), generator=rng).numpy()
    for n, cols in ((48, 1), (5, 999), (30, 17), (1, 1000)):
        st.dev["pos"].fill_(-7)
        st.dev["tables"].fill_(-7)
        st.upload_columns("tables", n, cols)
        torch.cuda.synchronize()
        assert st.dev["pos"].cpu().numpy().tolist() == st.host["pos"].tolist()
        got = st.dev["tables"].cpu().numpy()
        assert (got[:n, :cols] == st.host["tables"][:n, :cols]).all(), (n, cols)
        if cols < width:
            assert (got[:n, cols:] == -7).all() and (got[n:] == -7).all(), (n, cols)
