"""Pipelined graph decode (services/executor/decode_pipeline.py) on the CPU emulation of the
decode graphs: an engine that launches each step ahead, uses it for the rows still running and
discards it when the next plan needs something else must produce exactly the eager engine's
tokens, under churn (arrivals, finishes, preemption, block boundaries, non-greedy requests that
take the ordinary path)."""

from __future__ import annotations

import random

from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, tokenizer
from tests.engine.test_graph_padding import _emulated_graph_runner, run_arrivals


def llama_config(**sizes) -> EngineConfig:
    """The tiny llama checkpoint with a 128-token context and the given pool and batch sizes."""
    return EngineConfig(model=str(checkpoint("llama")), max_model_len=128, **sizes)


def test_pipelined_decode_equals_eager_under_churn(monkeypatch) -> None:
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    rng = random.Random()
    cfg = llama_config(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48)
    runner = _emulated_graph_runner(cfg, 4)
    runner.pipeline = DecodePipeline(runner, max_batch=4)
    V = len(tokenizer())
    arrivals = []
    for i in range(12):
        # The first three (greedy, short prompts, at step 0) give the pipeline a steady stretch
        # before the others start arriving at step 12 and churn the batch.
        long_greedy = i < 3
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 16 if long_greedy else 50))]
        max_tokens = 40 if long_greedy else rng.randint(1, 45)
        params = SamplingParams(
            temperature=0.0 if long_greedy else rng.choice((0.0, 0.0, 0.0, 0.9)),
            max_tokens=max_tokens,
            ignore_eos=long_greedy or rng.random() < 0.7,
            min_tokens=0 if long_greedy else min(max_tokens, rng.choice((0, 0, 3))),
            seed=rng.randrange(1 << 30),
        )
        arrivals.append((0 if long_greedy else rng.randrange(12, 30), f"r{i}", prompt, params))
    piped = run_arrivals(LLMEngine(cfg, runner), arrivals, 25)
    eager = run_arrivals(LLMEngine(cfg), arrivals, 25)
    assert piped == eager
    p = runner.pipeline
    print("pipeline launched", p.launched, "used", p.used, "dropped rows", p.dropped_rows)
    assert p.used >= 5, (p.launched, p.used)  # steps whose ids were already on their way
    # Finishes leave rows of a launched step behind: the step is used without them.
    assert p.dropped_rows > 0, (p.launched, p.used)


def test_pipeline_switch(monkeypatch) -> None:
    from voltserve.services.executor.decode_pipeline import pipeline_enabled
    from voltserve.services.executor.model_runner import ModelRunner

    monkeypatch.delenv("VOLTSERVE_PIPELINE_DECODE", raising=False)
    assert pipeline_enabled()  # on by default
    for off in ("0", "off", "false"):
        monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", off)
        assert not pipeline_enabled()
    monkeypatch.delenv("VOLTSERVE_PIPELINE_DECODE")
    # Without CUDA graphs (here: CPU) there is nothing to launch ahead.
    cfg = EngineConfig(model=str(checkpoint("llama")), num_kv_blocks=8, max_model_len=64)
    assert ModelRunner(cfg).pipeline is None


def test_pipeline_continues_across_block_boundaries(monkeypatch) -> None:
    """A steady greedy batch of 12 whose rows cross block boundaries at different steps: with the batcher's lookahead
    slot every decode step after the first is the one launched ahead; without it most steps
    have a row at a boundary and are not. Tokens equal the eager engine's either way."""
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    rng = random.Random()
    cfg = llama_config(num_kv_blocks=48, max_num_seqs=12, max_num_batched_tokens=256)
    V = len(tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    arrivals = [
        (0, f"r{i}", [rng.randrange(V) for _ in range(rng.randint(1, 20))], params)
        for i in range(12)
    ]
    eager = run_arrivals(LLMEngine(cfg), arrivals, 5)
    used = {}
    for lookahead in (1, 0):
        runner = _emulated_graph_runner(cfg, 12)
        runner.pipeline = DecodePipeline(runner, max_batch=12)
        engine = LLMEngine(cfg, runner)
        assert engine.batcher.lookahead_slots == 1  # what the engine gives a pipelined runner
        engine.batcher.lookahead_slots = lookahead
        assert run_arrivals(engine, arrivals, 5) == eager
        used[lookahead] = runner.pipeline.used
    # 39 decode steps after the prefill step: the first is launched as the step itself.
    assert used[1] >= 37, used
    assert used[0] <= used[1] - 5, used  # a row at a boundary stops it (~20 in practice)


def test_pipeline_max_batch_switch(monkeypatch) -> None:
    import pytest
    from voltserve.services.executor.decode_pipeline import DEFAULT_MAX_BATCH, pipeline_max_batch

    monkeypatch.delenv("VOLTSERVE_PIPELINE_MAX_BATCH", raising=False)
    assert pipeline_max_batch() == DEFAULT_MAX_BATCH
    monkeypatch.setenv("VOLTSERVE_PIPELINE_MAX_BATCH", "256")
    assert pipeline_max_batch() == 256
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("VOLTSERVE_PIPELINE_MAX_BATCH", bad)
        with pytest.raises(ValueError, match="VOLTSERVE_PIPELINE_MAX_BATCH"):
            pipeline_max_batch()


def test_pipelined_engine_admits_after_going_idle(monkeypatch) -> None:
    """A request that runs to its length limit leaves no step in flight that holds back the
    next request (the bench's batch-1 run followed by a batch: the second must be admitted),
    and each round's tokens equal the eager engine's."""
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    rng = random.Random()
    cfg = llama_config(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)
    runner = _emulated_graph_runner(cfg, 4)
    runner.pipeline = DecodePipeline(runner)
    piped, eager = LLMEngine(cfg, runner), LLMEngine(cfg)
    V = len(tokenizer())
    for n in (1, 3, 1):
        prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 20), ignore_eos=True)
        assert piped.generate(prompts, params) == eager.generate(prompts, params)
        assert piped.check_all_free()
    assert runner.pipeline.used > 0
