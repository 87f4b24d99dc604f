"""Quantized checkpoints served through the real services: greedy completions and chat over
HTTP equal transformers on the independent reference (teacher-forced, ties either way:
tests/greedy_reference.py) (the helper's dequantized weights for AWQ,
the .gguf file itself for GGUF), and the chosen tokens' logprobs agree within 1e-4. The GGUF
stack gets its tokenizer and chat template from the file's metadata in the renderer and the
gateway (there are no tokenizer files beside it)."""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import quant_checkpoints as qc
from tests.checkpoints import tokenizer
from tests.greedy_reference import check_greedy, token_ids

from .conftest import start_stack

LOGPROB_ATOL = 1e-4


def _cases():
    return {
        "awq-g128-llama": lambda: (qc.awq_checkpoint("llama", 128), None),
        "gguf-q4_k_m-qwen3": lambda: (
            qc.gguf_checkpoint("qwen3", qc.q4_k_m_types, "Q4_K_M"),
            "model.gguf",
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_quantized_model_over_http_equals_transformers(case: str, tmp_path: Path) -> None:
    made, gguf_file = _cases()[case]()
    if gguf_file is None:
        served, ref = made
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    else:
        served = made / gguf_file
        model = AutoModelForCausalLM.from_pretrained(made, gguf_file=gguf_file, dtype=torch.float32)
        assert not any(made.glob("tokenizer*"))  # the tokenizer can only come from the GGUF
    tok = tokenizer()
    stack = start_stack(served, tmp_path / "stack")
    try:
        client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)
        rng = random.Random(random.getrandbits(64))  # from the per-test seed (tests/conftest.py)
        prompt_ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 30))]
        r = client.completions.create(
            model="tiny",
            prompt=prompt_ids,
            max_tokens=8,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        ids = token_ids(r.choices[0].logprobs.tokens)
        assert len(ids) == 8 and r.choices[0].text == tok.decode(ids, skip_special_tokens=True)
        check_greedy(model, prompt_ids, ids, r.choices[0].logprobs.token_logprobs, LOGPROB_ATOL)

        messages = [
            {"role": "user", "content": " ".join(rng.choice(["cat", "sun", "é"]) for _ in range(5))}
        ]
        chat_ids = list(
            tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        content = r.choices[0].logprobs.content
        ids = token_ids([c.token for c in content])
        assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
        check_greedy(model, chat_ids, ids, [c.logprob for c in content], LOGPROB_ATOL)
        assert r.usage.prompt_tokens == len(chat_ids)
    finally:
        stack.stop()
