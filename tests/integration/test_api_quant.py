"""Quantized checkpoints served through the real services: greedy completions and chat over
HTTP equal transformers on the independent reference (the helper's dequantized weights for AWQ,
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


def _greedy(model, prompt: list[int], n: int):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    ids = out.sequences[0, len(prompt) :].tolist()
    return ids, torch.log_softmax(torch.cat(out.logits).float(), -1)


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
    model.generation_config.eos_token_id = None
    tok = tokenizer()
    stack = start_stack(served, tmp_path / "stack")
    try:
        client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)
        rng = random.Random()
        prompt_ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 30))]
        want, lp = _greedy(model, prompt_ids, 8)
        r = client.completions.create(
            model="tiny",
            prompt=prompt_ids,
            max_tokens=8,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True), prompt_ids
        got = r.choices[0].logprobs.token_logprobs
        assert len(got) == 8
        for step, (t, v) in enumerate(zip(want, got)):
            assert abs(v - lp[step, t].item()) < LOGPROB_ATOL

        messages = [
            {"role": "user", "content": " ".join(rng.choice(["cat", "sun", "é"]) for _ in range(5))}
        ]
        chat_ids = list(
            tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        want, _ = _greedy(model, chat_ids, 6)
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(chat_ids)
    finally:
        stack.stop()
