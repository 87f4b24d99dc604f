"""Prompt logprobs (SamplingParams.prompt_logprobs) computed in prefill equal transformers'
teacher-forced log-softmax over the same prompt, through chunked prefill, beside other requests,
and when the prompt's blocks are already in the prefix cache (such a request recomputes them).

Tolerance: fp32 on CPU on both sides, the same math in a different order: 1e-4 absolute."""

from __future__ import annotations

import functools

import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint

VOCAB = 384
ATOL = 1e-4


@functools.cache
def hf_model(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32).eval()


def reference(arch: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row p is log P(. | prompt[: p + 1]), teacher forced."""
    with torch.no_grad():
        logits = hf_model(arch)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, p) in reqs.items():
        engine.add_request(rid, prompt, p)
    got: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got, "prompt logprobs sent twice"
                assert out.prompt_token_ids == reqs[out.request_id][0]
                got[out.request_id] = out.prompt_logprobs
    return got


def check(arch: str, prompt: list[int], entries, k: int) -> None:
    ref = reference(arch, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        tok = prompt[p]
        assert abs(e["logprob"] - float(row[tok])) < ATOL, (p, e["logprob"], float(row[tok]))
        # 1 + the tokens more likely; a near tie may count either way.
        lo, hi = (int((row > row[tok] + d).sum()) + 1 for d in (ATOL, -ATOL))
        assert lo <= e["rank"] <= hi, (p, e["rank"], lo, hi)
        assert len(e["top"]) == k
        if k:
            tv, ti = row.topk(k)
            assert [t for t, _ in e["top"]][:1] == ti.tolist()[:1]
            assert max(abs(v - float(r)) for (_, v), r in zip(e["top"], tv)) < ATOL


def test_prompt_logprobs_chunked_and_batched(rng) -> None:
    arch = "qwen2"
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint(arch)),
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=13,  # chunks that cut prompts mid-block
            num_kv_blocks=64,
        )
    )
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 45))] for _ in range(3)]
    prompts.append([rng.randrange(VOCAB)])  # one token: nothing to score
    params = [
        SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k, ignore_eos=True)
        for k in (0, 3, 1, 2)
    ]
    reqs = {f"r{i}": (pr, p) for i, (pr, p) in enumerate(zip(prompts, params))}
    # A neighbour without prompt logprobs in the same steps.
    reqs["plain"] = (prompts[0], SamplingParams(max_tokens=3, temperature=0.0))
    got = run(engine, reqs)
    assert "plain" not in got
    for i, pr in enumerate(prompts):
        check(arch, pr, got[f"r{i}"], params[i].prompt_logprobs)
    assert engine.check_all_free()


def test_prompt_logprobs_with_a_prefix_cache_hit(rng) -> None:
    arch = "qwen2"
    engine = LLMEngine(
        EngineConfig(model=str(checkpoint(arch)), device="cpu", dtype="float32", num_kv_blocks=64)
    )
    prompt = [rng.randrange(VOCAB) for _ in range(53)]
    # First a request that fills the prefix cache with the prompt's full blocks.
    run(engine, {"warm": (prompt, SamplingParams(max_tokens=1, temperature=0.0))})
    again = run(engine, {"hit": (prompt, SamplingParams(max_tokens=1, temperature=0.0))})
    assert again == {}
    assert engine.block_manager.prefix_cache_hits >= 48  # the cache does hold the prefix
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    got = run(engine, {"scored": (prompt, p), "scored2": (prompt + [5, 6], p)})
    check(arch, prompt, got["scored"], 2)
    check(arch, prompt + [5, 6], got["scored2"], 2)
