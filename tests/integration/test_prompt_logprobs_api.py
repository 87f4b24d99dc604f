"""Echo, logprobs over the prompt and vLLM's prompt_logprobs through the real services and the
official openai client, against transformers' teacher-forced log-softmax on the same token ids
(fp32 on CPU both sides: within 1e-4), with and without a prefix-cache hit; lm-evaluation-
harness's local-completions model running a log-likelihood task on local data; the small vLLM
extras (/version, /ping, return_tokens_as_token_ids, continuous usage, token bytes)."""

from __future__ import annotations

import functools
import json
import os
import random
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ATOL = 1e-4
SEED = int(os.environ.get("VS_PLP_SEED", "99"))


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tok(stack):
    return AutoTokenizer.from_pretrained(stack.model)


@functools.cache
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p = log P(. | ids[:p]) for p >= 1 (row 0 unused)."""
    with torch.no_grad():
        lp = torch.log_softmax(_hf(path)(torch.tensor([ids])).logits[0].float(), dim=-1)
    return torch.cat([torch.zeros_like(lp[:1]), lp[:-1]])


def prompt_ids(rng: random.Random, tok, n: int) -> list[int]:
    # Token ids that decode to text which encodes back to the same ids (so a text prompt and
    # its id form agree), drawn from ordinary words.
    words = "the cache block server token model stream batch memory kernel value".split()
    text = " ".join(rng.choice(words) for _ in range(n))
    return tok.encode(text)


def get(stack, path: str):
    with urllib.request.urlopen(stack.base_url() + path, timeout=10) as r:
        return r.status, json.loads(r.read())


def test_echo_logprobs_match_transformers(stack, client, tok) -> None:
    rng = random.Random(SEED)
    ids = prompt_ids(rng, tok, 40)  # > 2 blocks: cacheable
    ref = reference(stack.model, ids)
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
    for attempt in ("after a plain request cached the prefix", "again"):
        r = client.completions.create(
            model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
        )
        ch = r.choices[0]
        lp = ch.logprobs
        assert ch.text == tok.decode(ids) + plain.choices[0].text, attempt
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        for p in range(1, len(ids)):
            want = float(ref[p, ids[p]])
            assert abs(lp.token_logprobs[p] - want) < ATOL, (attempt, p)
            [(label, top)] = lp.top_logprobs[p].items()
            assert abs(top - float(ref[p].max())) < ATOL
        # text_offset walks the echoed text token by token.
        assert lp.text_offset[0] == 0
        for p in range(1, len(lp.tokens)):
            assert lp.text_offset[p] == lp.text_offset[p - 1] + len(lp.tokens[p - 1])
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_prompt_logprobs_vllm_shape(stack, client, tok) -> None:
    rng = random.Random(SEED + 1)
    ids = prompt_ids(rng, tok, 20)
    ref = reference(stack.model, ids)
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        me = entry[str(ids[p])]
        assert abs(me["logprob"] - float(ref[p, ids[p]])) < ATOL
        rank = int((ref[p] > ref[p, ids[p]]).sum()) + 1
        assert abs(me["rank"] - rank) <= 1  # a near tie may count either way
        assert me["decoded_token"] == tok.decode([ids[p]])
        top2 = ref[p].topk(2)
        for r_, t in enumerate(top2.indices.tolist(), start=1):
            if str(t) in entry and t != ids[p]:
                assert entry[str(t)]["rank"] == r_
        assert len(entry) in (2, 3)
    # Chat: beside the choices, over the templated prompt.
    messages = [{"role": "user", "content": "the cache block server"}]
    c = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    body = json.dumps({"messages": messages}).encode()
    req = urllib.request.Request(
        stack.base_url() + "/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req) as resp:
        chat_ids = json.loads(resp.read())["tokens"]
    ref = reference(stack.model, chat_ids)
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(chat_ids) == c.usage.prompt_tokens
    for p in range(1, len(chat_ids)):
        [(k, v)] = plp[p].items()
        assert int(k) == chat_ids[p] and abs(v["logprob"] - float(ref[p, chat_ids[p]])) < ATOL


def test_echo_streaming_and_max_tokens_zero(client, tok) -> None:
    prompt = "the stream token model"
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text.startswith(prompt)
    assert chunks[0].choices[0].text.startswith(prompt)
    lps = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert lps == whole.choices[0].logprobs.token_logprobs
    # max_tokens 0 with echo: the prompt and its logprobs only, no completion tokens.
    z = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1
    )
    assert z.choices[0].text == prompt and z.usage.completion_tokens == 0
    n = len(tok.encode(prompt))
    assert len(z.choices[0].logprobs.token_logprobs) == n
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_lm_eval_loglikelihood_task(stack, tok, tmp_path) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    rng = random.Random(SEED + 2)
    words = "the cache block server token model stream batch memory kernel value".split()
    docs = [
        {
            "context": " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))),
            "continuation": " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))),
        }
        for _ in range(6)
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "task.yaml").write_text(
        f"""task: voltserve_local_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
    )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny",
            "base_url": stack.base_url() + "/v1/completions",
            "tokenizer": stack.model,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["voltserve_local_ll"],
        # Only the task written here: indexing lm-eval's own thousands of task files costs
        # seconds of CPU and none of them runs.
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    samples = sorted(results["samples"]["voltserve_local_ll"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for s, d in zip(samples, docs):
        ctx = tok.encode(d["context"])
        whole = tok.encode(d["context"] + d["continuation"])
        assert whole[: len(ctx)] == ctx
        ref = reference(stack.model, whole)
        want = sum(float(ref[p, whole[p]]) for p in range(len(ctx), len(whole)))
        greedy = all(int(ref[p].argmax()) == whole[p] for p in range(len(ctx), len(whole)))
        (ll, is_greedy) = s["resps"][0][0]
        assert abs(ll - want) < ATOL * len(whole), (s, want)
        assert is_greedy == greedy


def test_small_endpoints_and_extras(stack, client, tok) -> None:
    status, v = get(stack, "/version")
    assert status == 200 and isinstance(v["version"], str)
    assert get(stack, "/ping")[0] == 200
    models = client.models.list().data
    assert models[0].model_extra["max_model_len"] == 512
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for e in r.choices[0].logprobs.content:
        assert e.token.startswith("token_id:")
        tid = int(e.token.split(":")[1])
        assert e.top_logprobs[0].token.startswith("token_id:")
        if tid not in tok.added_tokens_decoder:
            assert e.bytes == _own_bytes(tok, tid)
    # A token holding part of a UTF-8 character: its own byte, not U+FFFD's three.
    added = set(tok.added_tokens_decoder)
    lone = next(
        t
        for t in range(len(tok))
        if t not in added and len(_own_bytes(tok, t)) == 1 and _own_bytes(tok, t)[0] >= 0xC2
    )
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        logit_bias={str(lone): 100},
    )
    e = r.choices[0].logprobs.content[0]
    assert e.token == "\ufffd" and e.bytes == _own_bytes(tok, lone)
    # Usage on every chunk with continuous_usage_stats.
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="the model",
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts and all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 4


def _own_bytes(tok, t: int) -> list[int]:
    """A byte-level token's bytes, from transformers' own copy of GPT-2's byte table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = {c: b for b, c in bytes_to_unicode().items()}
    return [table[c] for c in tok.convert_ids_to_tokens(t)]
