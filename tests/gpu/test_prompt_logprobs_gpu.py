"""On a CUDA GPU: prompt logprobs computed in prefill (SamplingParams.prompt_logprobs) equal
transformers' teacher-forced log-softmax, through chunked prefill (a last chunk of one token
runs as a CUDA-graph decode step), beside plain requests and after a prefix-cache hit.

Tolerances: fp32 runner vs transformers fp32 on the same GPU: 2e-3 (different kernels and
accumulation order); fp16 runner vs transformers fp32: 0.08 (fp16 weights and activations)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import ARCHS, checkpoint, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = {"float32": 2e-3, "float16": 0.08}


@functools.cache
def _hf(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32).cuda().eval()


def _reference(arch: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf(arch)(torch.tensor([ids], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].cpu()  # row p: P(. | ids[: p + 1])


def _run(engine: LLMEngine, reqs: dict) -> dict:
    for rid, (prompt, p) in reqs.items():
        engine.add_request(rid, prompt, p)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    return got


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_gpu(arch: str, dtype: str) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint(arch)),
            dtype=dtype,
            device="cuda",
            num_kv_blocks=256,
            max_model_len=256,
            max_num_batched_tokens=24,
            max_graph_batch_size=8,
        )
    )
    rng = random.Random(7)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (25, 40, 7, 120)]
    p = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    # Warm the prefix cache with the first prompt, then score all of them beside a plain one.
    _run(engine, {"warm": (prompts[0], SamplingParams(max_tokens=2, temperature=0.0))})
    reqs = {f"r{i}": (pr, p) for i, pr in enumerate(prompts)}
    reqs["plain"] = (prompts[1], SamplingParams(max_tokens=4, temperature=0.0))
    got = _run(engine, reqs)
    assert set(got) == {f"r{i}" for i in range(len(prompts))}
    for i, pr in enumerate(prompts):
        ref = _reference(arch, pr)
        entries = got[f"r{i}"]
        assert len(entries) == len(pr) and entries[0] is None
        err = max(abs(entries[q]["logprob"] - float(ref[q - 1, pr[q]])) for q in range(1, len(pr)))
        assert err < ATOL[dtype], (arch, dtype, i, err)
        for q in range(1, len(pr)):
            top = entries[q]["top"]
            assert len(top) == 2 and top[0][1] >= top[1][1]
            assert abs(top[0][1] - float(ref[q - 1].max())) < ATOL[dtype]
    assert engine.check_all_free()
