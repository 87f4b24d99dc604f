"""Greedy output through the HTTP API equals transformers for the other tiny architectures
(qwen2 is covered in test_api.py)."""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.checkpoints import checkpoint

from .conftest import start_stack
from .test_api import hf_greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_chat_and_completion_equal_transformers(arch: str, tmp_path: Path) -> None:
    model = checkpoint(arch)
    tok = AutoTokenizer.from_pretrained(model)
    stack = start_stack(model, tmp_path / "stack")
    try:
        client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)
        rng = random.Random(random.getrandbits(64))
        prompt_ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 30))]
        r = client.completions.create(
            model="tiny",
            prompt=prompt_ids,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == tok.decode(
            hf_greedy(str(model), prompt_ids, 10), skip_special_tokens=True
        )

        messages = [
            {
                "role": "user",
                "content": " ".join(rng.choice(["cat", "dog", "sun", "é"]) for _ in range(6)),
            }
        ]
        chat_ids = list(
            tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        want = tok.decode(hf_greedy(str(model), chat_ids, 8), skip_special_tokens=True)
        kw = dict(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(chat_ids) and r.usage.completion_tokens == 8
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(stream=True, **kw)
        )
        assert streamed == want
    finally:
        stack.stop()
