"""Speculative decoding behind the HTTP API: an executor started with --speculative-config
(n-gram) answers exactly what the engine without speculation generates, stop strings inside an
accepted run end the text, usage and logprobs where one token per step would, and /metrics
shows vLLM's spec_decode counters. One stack for the module."""

from __future__ import annotations

import json
import random
import re

import openai
import pytest
from transformers import AutoTokenizer
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.integration.conftest import Stack

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_stack(tiny_model, tmp_path_factory):
    s = Stack(tiny_model, tmp_path_factory.mktemp("spec-stack"))
    try:
        s.add_scheduler()
        s.add_renderer()
        s.add_executor("executor-0", "--speculative-config", json.dumps(SPEC))
        s.add_gateway()
        s.wait_ready()
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def test_spec_api_equals_engine_without_speculation(spec_stack, tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    client = openai.OpenAI(base_url=spec_stack.base_url() + "/v1", api_key="x", max_retries=0)
    rng = random.Random(7)
    phrase = [rng.randrange(3, len(tok)) for _ in range(12)]
    prompts = [phrase * 4, [rng.randrange(3, len(tok)) for _ in range(9)] * 3]
    eng = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = eng.generate(prompts, params)
    for p, w in zip(prompts, want):
        r = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=40,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        c = r.choices[0]
        assert c.text == tok.decode(w, skip_special_tokens=False)
        assert r.usage.completion_tokens == 40
        assert len(c.logprobs.token_logprobs) == 40
        # A stop string in the middle of the output: the text ends before it, and usage counts
        # the tokens up to the one that completes it, as one token per step would.
        full = c.text
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        if not stop.strip():
            continue
        j = next(i for i in range(len(w)) if stop in tok.decode(w[: i + 1]))
        r = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=40,
            temperature=0,
            logprobs=1,
            stop=[stop],
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert c.text == full[: full.index(stop)]
        assert r.usage.completion_tokens == j + 1
        assert len(c.logprobs.token_logprobs) == j + 1
    drafts, text = spec_stack.spec_drafts()
    assert drafts > 0, text[:2000]
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in text


def test_spec_api_constrained_equals_engine_without_speculation(spec_stack, tiny_model):
    """Constrained requests (regex, choice) under speculation: the text satisfies the
    constraint and equals the constrained output of the engine without speculation."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    client = openai.OpenAI(base_url=spec_stack.base_url() + "/v1", api_key="x", max_retries=0)
    pattern = r"[a-z]{2,4}-[0-9]{1,2}"
    choices = ["yes", "no", "maybe so"]
    # Prompts that hold text of the constraints' shape: n-gram lookup proposes from them.
    prompt = tok.encode("ab-12 cd-3 yes no maybe so xyz-45 maybe so ab-12 id:")
    cases = [
        ({"structured_outputs": {"regex": pattern}}, {"type": "regex", "value": pattern}),
        ({"structured_outputs": {"choice": choices}}, {"type": "choice", "value": choices}),
    ]
    eng = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32"))
    for body, structured in cases:
        want = eng.generate(
            [prompt], SamplingParams(max_tokens=30, temperature=0.0, structured=structured)
        )[0]
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body=body
        )
        c = r.choices[0]
        assert c.finish_reason == "stop"
        if structured["type"] == "regex":
            assert re.fullmatch(pattern, c.text), c.text
        else:
            assert c.text in choices
        assert c.text == tok.decode(want, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(want)
