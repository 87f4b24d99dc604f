"""Hybrid linear-attention models (Qwen3.5 / 3.6, Qwen3-Next) through the real engine against
transformers, token for token (fp32, CPU): one request at a time, 8 at once, with chunked
prefill (a small token budget) and forced preemption (a KV pool too small for the batch)."""

from __future__ import annotations

import functools

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import HYBRID_ARCHS, checkpoint, greedy_tokens, hf_model_class, tokenizer

MAX_NEW = 8


@functools.cache
def hf_model(arch: str):
    path = checkpoint(arch)
    return hf_model_class(path).from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_matches_transformers(arch: str, rng) -> None:
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 45))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [greedy_tokens(hf_model(arch), p, MAX_NEW) for p in prompts]
    # A 16-token budget splits every longer prompt into chunks; 9 blocks of 16 tokens hold
    # fewer than the 8 requests' 8-40 tokens each, so the newest are preempted and recomputed.
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint(arch)),
            num_kv_blocks=9,
            max_num_batched_tokens=16,
            max_num_seqs=8,
        )
    )
    assert engine.generate(prompts, params) == want
    assert engine.batcher.num_preemptions > 0
    assert engine.check_all_free()
    # One at a time, reusing the slots the batch gave back.
    for p, w in zip(prompts[:2], want[:2]):
        assert engine.generate([p], params) == [w]
    assert engine.check_all_free()
