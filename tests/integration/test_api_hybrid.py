"""A hybrid linear-attention model through the real services: the tiny Qwen3.5 checkpoint in its
vision-language layout (as the published checkpoints are), served from its text part, with its
MTP layers (written by the test) proposing for speculative decoding. Concurrent greedy
completions equal transformers' vision-language class token for token, /metrics counts the
drafts, and an image in a chat message is a 400 that says image inputs are not served."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.checkpoints import checkpoint, greedy_tokens, hf_model_class
from tests.mtp_checkpoints import mtp_checkpoint

from .conftest import Stack

MAX_NEW = 6


def test_hybrid_vl_checkpoint_over_http(tmp_path: Path, rng: random.Random) -> None:
    model = checkpoint("qwen3_5_vl")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    (tmp_path / "stack").mkdir()
    stack = Stack(mtp_checkpoint("qwen3_5_vl"), tmp_path / "stack")
    try:
        stack.add_scheduler()
        stack.add_renderer()
        spec = {"method": "qwen3_5_mtp", "num_speculative_tokens": 2}
        stack.add_executor("executor-0", "--speculative-config", json.dumps(spec))
        stack.add_gateway()
        stack.wait_ready()
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
        drafts, _ = stack.spec_drafts()
    finally:
        stack.stop()
    assert drafts > 0
    assert "image inputs are not supported" in e.value.message
    assert e.value.body["param"] == "messages"
    ref = hf_model_class(model).from_pretrained(model, dtype=torch.float32).eval()
    for p, r in zip(prompts, results):
        want = greedy_tokens(ref, p, MAX_NEW)
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True), f"prompt {p}"
