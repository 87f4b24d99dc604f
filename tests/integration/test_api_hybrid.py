"""A hybrid linear-attention model through the real services: the tiny Qwen3.5 checkpoint in its
vision-language layout (as the published checkpoints are), served from its text part.
Concurrent greedy completions equal transformers' vision-language class token for token, and
an image in a chat message is a 400 that says image inputs are not served."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.checkpoints import checkpoint, greedy_tokens, hf_model_class

from .conftest import start_stack

MAX_NEW = 6


def test_hybrid_vl_checkpoint_over_http(tmp_path: Path, rng: random.Random) -> None:
    model = checkpoint("qwen3_5_vl")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    stack = start_stack(model, tmp_path / "stack")
    try:
        client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)

        def complete(p: list[int]):
            return client.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=MAX_NEW,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(complete, prompts))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny",
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}],
                    }
                ],
            )
    finally:
        stack.stop()
    assert "image inputs are not supported" in e.value.message
    assert e.value.body["param"] == "messages"
    ref = hf_model_class(model).from_pretrained(model, dtype=torch.float32).eval()
    for p, r in zip(prompts, results):
        want = greedy_tokens(ref, p, MAX_NEW)
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True), f"prompt {p}"
