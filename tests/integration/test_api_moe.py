"""A mixture-of-experts model (the tiny Qwen3-MoE checkpoint: top-3 of 8 experts, a dense layer
between two sparse ones) through the real services: concurrent greedy completions equal
transformers token for token (teacher-forced, ties either way: tests/greedy_reference.py), and
their logprobs agree within LOGPROB_ATOL. The same for its
AWQ int4 version (experts quantized too; tests/quant_checkpoints.py) and its compressed-tensors
NVFP4 version (every attention and expert projection FP4, written by the library's own
compressor; tests/fp4_checkpoints.py), each against transformers on the dense folder of its
reference weights (for NVFP4, what compressed-tensors' own decompressor gives)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.checkpoints import checkpoint
from tests.greedy_reference import check_greedy, token_ids

from .conftest import start_stack

LOGPROB_ATOL = 1e-3  # fp32 on CPU; the API rounds nothing, the margin covers summation order


def _model(kind: str) -> tuple[Path, Path]:
    """(served folder, transformers reference folder)."""
    if kind == "float":
        return checkpoint("qwen3_moe"), checkpoint("qwen3_moe")
    if kind == "ct-nvfp4":
        from tests.fp4_checkpoints import ct_fp4_checkpoint

        return ct_fp4_checkpoint("qwen3_moe", "nvfp4")
    from tests.quant_checkpoints import awq_checkpoint

    return awq_checkpoint("qwen3_moe", 32)


@pytest.mark.parametrize("kind", ["float", "awq-int4", "ct-nvfp4"])
def test_moe_concurrent_greedy_and_logprobs_equal_transformers(
    kind: str, tmp_path: Path, rng: random.Random
) -> None:
    model, ref = _model(kind)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    stack = start_stack(model, tmp_path / "stack")
    try:
        client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)

        def complete(p: list[int]):
            return client.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=8,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(complete, prompts))
    finally:
        stack.stop()
    reference = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    for p, r in zip(prompts, results, strict=True):
        choice = r.choices[0]
        ids = token_ids(choice.logprobs.tokens)
        assert len(ids) == 8 and choice.text == tok.decode(ids, skip_special_tokens=True)
        check_greedy(reference, p, ids, choice.logprobs.token_logprobs, LOGPROB_ATOL)
