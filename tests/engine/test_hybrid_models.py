"""Hybrid linear-attention models (Qwen3.5 / 3.6 dense and MoE, Qwen3-Next) through the real
engine against transformers, token for token (fp32, CPU; teacher-forced): 8 requests at once with chunked
prefill (a small token budget) and forced preemption (a KV pool too small for the batch), then
one at a time; the vision-language layout's text part; the state cache's sizing and refusals."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.kv_sizing import kv_bytes_per_block
from voltserve.services.executor.loader import ModelLoadError
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, hf_model_class, tokenizer
from tests.greedy_reference import check_greedy_outputs

MAX_NEW = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@functools.cache
def hf_model(arch: str):
    path = checkpoint(arch)
    return hf_model_class(path).from_pretrained(path, dtype=torch.float32).eval()


def _prompts(rng, n: int, lo: int, hi: int) -> list[list[int]]:
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_matches_transformers(arch: str, rng) -> None:
    prompts = _prompts(rng, 6, 16, 16)
    # An 8-token budget splits every prompt into chunks (a later chunk starts from the state
    # the earlier left). Every prompt fills one 16-token block, so each request's first decode
    # step needs a second one, and there are 3 blocks for 6 requests: a running request that
    # cannot grow preempts the newest, whose state slot is freed and whose state is rebuilt
    # from position 0 when it is admitted again.
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint(arch)),
            num_kv_blocks=3,
            max_num_batched_tokens=8,
            max_num_seqs=8,
        )
    )
    assert not engine.block_manager.enable_prefix_caching
    outs = engine.generate(prompts, PARAMS)
    check_greedy_outputs(hf_model(arch), prompts, outs, MAX_NEW)
    assert engine.batcher.num_preemptions > 0
    assert engine.check_all_free()
    # One at a time, on the slots the batch gave back.
    assert engine.generate([prompts[0]], PARAMS) == [outs[0]]
    assert engine.check_all_free()


def test_vision_language_layout_serves_its_text_model(rng) -> None:
    """Qwen3_5ForConditionalGeneration: text_config, weights under model.language_model.,
    the vision tower skipped; equal to transformers' vision-language class on text."""
    prompts = _prompts(rng, 3, 1, 40)
    engine = LLMEngine(EngineConfig(model=str(checkpoint("qwen3_5_vl")), num_kv_blocks=16))
    assert engine.runner.arch.architecture == "Qwen3_5ForConditionalGeneration"
    outs = engine.generate(prompts, PARAMS)
    check_greedy_outputs(hf_model("qwen3_5_vl"), prompts, outs, MAX_NEW)


def test_state_cache_is_sized_with_the_kv_cache() -> None:
    """One slot per max_num_seqs; its bytes come out of the CPU KV budget; the KV cache holds
    the full-attention layers only."""
    path = str(checkpoint("qwen3_5"))
    budget = 1 << 20
    r = ModelRunner(EngineConfig(model=path, cpu_kv_cache_bytes=budget, max_num_seqs=4))
    cache = r.state_cache
    assert cache.num_slots == 4 and len(cache.layers) == 2  # layers 0 and 1 are linear
    conv, rec = cache.layers[0]
    # conv_dim = 2 * 2 key heads * 16 + 4 value heads * 16; kernel 4
    assert conv.shape == (4, 128, 3) and conv.dtype == torch.float32
    assert rec.shape == (4, 4, 16, 16) and rec.dtype == torch.float32
    assert cache.nbytes == 2 * 4 * (128 * 3 + 4 * 16 * 16) * 4
    assert len(r.kv_caches) == 2  # layers 2 and 3
    assert r.num_kv_blocks == (budget - cache.nbytes) // kv_bytes_per_block(r)


def test_a_model_without_a_full_attention_layer_is_refused_by_name(tmp_path) -> None:
    """Every layer linear attention: no layer keeps a KV cache, which the engine needs."""
    d = tmp_path / "m"
    shutil.copytree(checkpoint("qwen3_5"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no full-attention layer.*4 layers"):
        ModelRunner(engine_config(model=str(d)))


def test_unsupported_options_are_refused_by_name() -> None:
    path = str(checkpoint("qwen3_5"))
    # Speculation with state rollback serves ngram, draft_model (test_hybrid_spec.py) and mtp
    # (test_hybrid_mtp.py).
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": path}
    with pytest.raises(ValueError, match="speculative-config.*Qwen3_5ForCausalLM.*'eagle'"):
        ModelRunner(engine_config(model=path, num_kv_blocks=8, speculative_config=spec))
    with pytest.raises(ValueError, match="enable-prefix-caching.*Qwen3_5ForCausalLM"):
        LLMEngine(EngineConfig(model=path, num_kv_blocks=8, enable_prefix_caching=True))


def test_a_row_without_a_state_slot_is_refused(rng) -> None:
    """The runner driven directly: a request the block manager did not admit has no state slot
    and would share slot -1 with another; it is refused by name, and with slots given it
    equals transformers."""
    from voltserve.services.executor.request import Request

    from tests.checkpoints import drive

    runner = ModelRunner(EngineConfig(model=str(checkpoint("qwen3_5")), num_kv_blocks=16))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = _prompts(rng, 2, 3, 20)
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    with pytest.raises(RuntimeError, match="r0 has no linear-attention state slot"):
        runner.execute(_plan(reqs))
    drive(runner, reqs, MAX_NEW, chunk=8)
    outs = [r.output_token_ids for r in reqs]
    check_greedy_outputs(hf_model("qwen3_5"), prompts, outs, MAX_NEW)


def _plan(reqs):
    from voltserve.services.executor.request import ScheduledRequest, StepPlan

    sched = [ScheduledRequest(r, r.num_tokens) for r in reqs]
    return StepPlan(sched, sum(s.num_new_tokens for s in sched))
