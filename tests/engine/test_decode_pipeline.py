"""Pipelined graph decode (services/executor/decode_pipeline.py) on the CPU emulation of the
decode graphs: an engine that launches each step ahead, uses it for the rows still running and
discards it when the next plan needs something else must produce exactly the eager engine's
tokens, under churn (arrivals, finishes, preemption, block boundaries, non-greedy requests that
take the ordinary path)."""

from __future__ import annotations

from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, tokenizer
from tests.engine.test_graph_padding import _emulated_graph_runner, run_arrivals
from tests.engine.token_match import assert_streams_match, requests_of


def llama_config(**sizes) -> EngineConfig:
    """The tiny llama checkpoint with a 128-token context and the given pool and batch sizes."""
    return EngineConfig(model=str(checkpoint("llama")), max_model_len=128, **sizes)


def test_pipelined_decode_equals_eager_under_churn(monkeypatch, rng) -> None:
    """Fresh random churn around a fixed core that forces what the test asserts, whatever the
    draw: r0-r2 (greedy, ignore_eos, prompts of one prefill chunk) arrive at step 0 and run alone
    until step 12, so the pipeline launches ahead for them every step; r2 stops at its length
    limit at step 5 while r0 and r1 go on, so the step launched with it is used without its row
    (a dropped row: r2's prompt is never 11 tokens long, which would put the slot of that step at
    a block boundary r2 is not given, since it ends there, and no step would be launched); r3 and r4 (50-token prompts, 45 tokens each, arriving at step 12) need 6
    blocks each beside r0's and r1's 4 while all four run, more than the 16 there are, so a
    request is preempted. The random requests (any sampling, EOS allowed) only add churn."""
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    cfg = llama_config(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48)
    runner = _emulated_graph_runner(cfg, 4)
    runner.pipeline = DecodePipeline(runner, max_batch=4)
    V = len(tokenizer())

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(V) for _ in range(n)]

    arrivals = [
        (0, "r0", prompt(16), greedy(40)),
        (0, "r1", prompt(rng.randint(9, 16)), greedy(40)),
        (0, "r2", prompt(rng.choice([n for n in range(1, 17) if n != 11])), greedy(6)),
        (12, "r3", prompt(50), greedy(45)),
        (12, "r4", prompt(50), greedy(45)),
    ]
    for i in range(5, 12):
        max_tokens = rng.randint(1, 45)
        params = SamplingParams(
            temperature=rng.choice((0.0, 0.0, 0.0, 0.9)),
            max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.7,
            min_tokens=min(max_tokens, rng.choice((0, 0, 3))),
            seed=rng.randrange(1 << 30),
        )
        arrivals.append((rng.randrange(12, 30), f"r{i}", prompt(rng.randint(1, 50)), params))
    piped_engine = LLMEngine(cfg, runner)
    piped = run_arrivals(piped_engine, arrivals, 25)
    eager = run_arrivals(LLMEngine(cfg), arrivals, 25)
    assert_streams_match(piped, eager, requests_of(arrivals), cfg.model)
    p = runner.pipeline
    print("pipeline launched", p.launched, "used", p.used, "dropped rows", p.dropped_rows)
    assert p.used >= 5, (p.launched, p.used)  # steps whose ids were already on their way
    # r2's finish leaves its row of a launched step behind: the step is used without it.
    assert p.dropped_rows > 0, (p.launched, p.used)
    assert piped_engine.batcher.num_preemptions > 0


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


def test_pipeline_continues_across_block_boundaries(monkeypatch, rng) -> None:
    """A steady greedy batch of 12 whose rows cross block boundaries at different steps: with
    the batcher's lookahead slot every decode step after the first is the one launched ahead;
    without it most steps have a row at a boundary and are not. Tokens equal the eager
    engine's either way. The prompt lengths are 12 distinct values of 1..16 (random order and
    choice), so the rows reach their boundaries at 12 different steps by construction."""
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    cfg = llama_config(num_kv_blocks=48, max_num_seqs=12, max_num_batched_tokens=256)
    V = len(tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    arrivals = [
        (0, f"r{i}", [rng.randrange(V) for _ in range(n)], params)
        for i, n in enumerate(rng.sample(range(1, 17), 12))
    ]
    eager = run_arrivals(LLMEngine(cfg), arrivals, 5)
    used = {}
    for lookahead in (1, 0):
        runner = _emulated_graph_runner(cfg, 12)
        runner.pipeline = DecodePipeline(runner, max_batch=12)
        engine = LLMEngine(cfg, runner)
        assert engine.batcher.lookahead_slots == 1  # what the engine gives a pipelined runner
        engine.batcher.lookahead_slots = lookahead
        assert_streams_match(
            run_arrivals(engine, arrivals, 5), eager, requests_of(arrivals), cfg.model
        )
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


def test_pipelined_engine_admits_after_going_idle(monkeypatch, rng) -> None:
    """A request that runs to its length limit leaves no step in flight that holds back the
    next request (the bench's batch-1 run followed by a batch: the second must be admitted),
    and each round's tokens equal the eager engine's."""
    from voltserve.services.executor.decode_pipeline import DecodePipeline

    monkeypatch.setenv("VOLTSERVE_PIPELINE_DECODE", "1")
    cfg = llama_config(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)
    runner = _emulated_graph_runner(cfg, 4)
    runner.pipeline = DecodePipeline(runner)
    piped, eager = LLMEngine(cfg, runner), LLMEngine(cfg)
    V = len(tokenizer())
    # The last round decodes at least 8 tokens, so some step is launched ahead and used on
    # every draw (with max_tokens 2 nothing follows the one decode step: nothing to pipeline).
    for n, least in ((1, 2), (3, 2), (1, 8)):
        prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(n)]
        max_tokens = rng.randint(least, 20)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert piped.generate(prompts, params) == eager.generate(prompts, params)
        assert piped.check_all_free()
    assert runner.pipeline.used > 0
