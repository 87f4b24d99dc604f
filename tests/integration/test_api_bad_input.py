"""Bad and unusual input against a real stack: raw aiohttp requests and the openai client.

The rule: bad input gets an OpenAI-style error JSON with a 4xx status that names the parameter,
never a 500, a hang or a dead service; unusual-but-valid input works. Decisions (see params.py):
null or absent optional fields take their defaults and unknown fields are ignored (vLLM);
0/1 for a boolean and an integral float for an integer are accepted (vLLM's lax pydantic);
strings are never numbers; up to 16 stop strings (OpenAI: 4); n up to 128; any role string goes
to the chat template (vLLM: custom roles such as Llama's "ipython"); batched prompts are a 400.
"""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp
import openai
import pytest
from voltserve.services.gateway.body_limits import MAX_JSON_DEPTH, default_max_request_bytes
from voltserve.services.gateway.params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from voltserve.services.gateway.tools import MAX_TOOLS
from voltserve.services.renderer.render import Renderer, position_limit

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(stack) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.model)


@pytest.fixture(scope="module")
def vocab(tok) -> int:
    return len(tok)


@pytest.fixture
async def http(stack):
    async with aiohttp.ClientSession(
        base_url=stack.base_url(), timeout=aiohttp.ClientTimeout(total=30)
    ) as s:
        yield s


async def call(
    http: aiohttp.ClientSession,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with http.request(method, path, data=data, headers=hdrs) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def check_error(status: int, body: Any, want: int, param: str | None = "", what: str = "") -> None:
    """An OpenAI error object with the wanted status (and param, unless param == "")."""
    assert status == want, (what, status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, (what, body)
    err = body["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    assert err["type"] == ("not_found_error" if want == 404 else "invalid_request_error"), err
    if param != "":
        assert err["param"] == param, (what, err)


def cmp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **kw}


# ---- the body itself ------------------------------------------------------------------------


async def test_malformed_bodies(http) -> None:
    digits = "".join(random.choice("123456789") for _ in range(random.randint(4400, 6000)))
    cases = [
        b"{not json",
        b"",
        b'{"model": "tiny", "prompt": "hi",}',
        b'{"prompt": "\xff\xfe"}',  # not UTF-8
        ('{"model":"tiny","prompt":"hi","max_tokens":' + digits + "}").encode(),  # past int limit
        b"prompt=hi&model=tiny",
    ]
    for raw in cases:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            status, body = await call(http, path, raw=raw)
            check_error(status, body, 400, None, raw[:40])
            assert "not valid JSON" in body["error"]["message"]
    for value in ([1, 2], "x", None, 3, True):
        status, body = await call(http, "/v1/completions", raw=json.dumps(value).encode())
        check_error(status, body, 400, None, value)
        assert "JSON object" in body["error"]["message"]


async def test_lone_surrogate_is_400_and_pairs_work(http) -> None:
    # json.dumps writes "\ud800" for a lone surrogate; no encoder downstream takes it.
    for where in (cmp(prompt="a\ud800b"), chat(messages=[{"role": "user", "content": "\udfff"}])):
        path = "/v1/completions" if "prompt" in where else "/v1/chat/completions"
        status, body = await call(http, path, where)
        check_error(status, body, 400, None, where)
        assert "surrogate" in body["error"]["message"]
    # An escaped surrogate pair is one ordinary character.
    status, body = await call(http, "/v1/completions", cmp(prompt="llama \ud83e\udd99"))
    assert status == 200, body


async def test_body_over_the_size_limit_is_413(stack, http) -> None:
    r = Renderer(stack.model)
    limit = default_max_request_bytes(position_limit(stack.model), r.span.max_token_bytes)
    raw = json.dumps(cmp(prompt="a" * (limit + random.randint(1, 4096)))).encode()
    paths = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"]
    for path in paths + ["/detokenize", "/v1/nope"]:
        status, body = await call(http, path, raw=raw)
        check_error(status, body, 413, None)
        assert str(limit) in body["error"]["message"]


async def test_nesting_past_the_parser_is_400(rng, http) -> None:
    depth = rng.randint(1000, 50_000)  # past Python's recursion limit: was a 500
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, body = await call(http, path, raw=b'{"x": ' + b"[" * depth + b"]" * depth + b"}")
        check_error(status, body, 400, None, path)
        assert "nested" in body["error"]["message"]


async def test_methods_and_unknown_routes(http) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for method in ("GET", "PUT", "DELETE"):
            status, body = await call(http, path, method=method)
            assert status == 405, (method, path, body)
            assert set(body["error"]) == ERROR_KEYS
        status, body = await call(http, path, method="HEAD")
        assert status == 405 and body == ""  # HEAD answers carry no body
    for path in ("/v1/nope", "/v1/embeddings", "/v1/completions/"):
        status, body = await call(http, path, {"model": MODEL})
        check_error(status, body, 404, None, path)
    # `/` is the chat page: GET only.
    status, body = await call(http, "/", {"model": MODEL})
    assert status == 405 and set(body["error"]) == ERROR_KEYS, body


# ---- parameter types and ranges -------------------------------------------------------------


def _wrong_values(rng: random.Random) -> list[Any]:
    junk = [{"a": rng.random()}, [rng.randint(0, 9)], "".join(rng.sample("abcdef", 3))]
    return [rng.choice(junk), str(rng.randint(1, 5)), True]


async def test_wrong_types_name_the_parameter(rng, http) -> None:
    number = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
    number += ["repetition_penalty"]
    integer = ["max_tokens", "n", "top_k", "seed", "min_tokens", "logprobs"]
    for name in number + integer:
        for v in _wrong_values(rng):
            status, body = await call(http, "/v1/completions", cmp(**{name: v}))
            check_error(status, body, 400, name, (name, v))
    for name in integer:
        v = rng.randint(1, 9) + 0.5
        status, body = await call(http, "/v1/completions", cmp(**{name: v}))
        check_error(status, body, 400, name, (name, v))
    for name in ("stream", "ignore_eos", "skip_special_tokens", "echo"):
        for v in ("true", 2, [True], {"x": 1}):
            status, body = await call(http, "/v1/completions", cmp(**{name: v}))
            check_error(status, body, 400, name, (name, v))
    chat_cases = [
        ("logprobs", "yes"),
        ("logprobs", 5),
        ("add_generation_prompt", "no"),
        ("chat_template_kwargs", [1]),
        ("max_completion_tokens", "8"),
        ("stream_options", [1]),
        ("response_format", "json"),
        ("tools", {"type": "function"}),
        ("stop", rng.randint(0, 9)),
        ("stop_token_ids", "1"),
        ("logit_bias", [1, 2]),
    ]
    for name, v in chat_cases:
        status, body = await call(http, "/v1/chat/completions", chat(**{name: v}))
        check_error(status, body, 400, name, (name, v))
    status, body = await call(
        http, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "y"})
    )
    check_error(status, body, 400, "stream_options")
    for model in (rng.randint(0, 9), [MODEL], {"id": MODEL}):
        status, body = await call(http, "/v1/completions", cmp(model=model))
        check_error(status, body, 400, "model", model)
    status, body = await call(http, "/v1/completions", cmp(model="no-such-model"))
    check_error(status, body, 404, "model")


async def test_integers_past_64_bits_are_400(http) -> None:
    big = (1 << 63) + random.randint(0, 1 << 40)
    for name in ("max_tokens", "top_k", "seed", "n", "min_tokens", "temperature"):
        status, body = await call(http, "/v1/completions", cmp(**{name: big}))
        check_error(status, body, 400, name, name)
        status, body = await call(http, "/v1/completions", cmp(**{name: -big}))
        check_error(status, body, 400, name, name)
    # Deep inside a message or the template kwargs: caught before anything is sent.
    huge = (1 << 64) + random.randint(0, 1 << 40)  # past msgpack's uint64 too
    deep = chat(messages=[{"role": "user", "content": "hi", "meta": huge}])
    status, body = await call(http, "/v1/chat/completions", deep)
    check_error(status, body, 400, None)
    status, body = await call(http, "/v1/chat/completions", chat(chat_template_kwargs={"x": -huge}))
    check_error(status, body, 400, None)


async def test_ranges(rng, http, vocab: int) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (cmp(n=0), "n"),
        (cmp(n=MAX_N + 1), "n"),
        (cmp(n=rng.randint(10**6, 10**12)), "n"),
        (cmp(max_tokens=0), "max_tokens"),
        (cmp(max_tokens=-rng.randint(1, 10**6)), "max_tokens"),
        (cmp(max_tokens=rng.randint(10**6, 10**12)), "max_tokens"),  # beyond the context
        (cmp(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
        (cmp(stop=["ok", rng.randint(0, 9)]), "stop"),
        (cmp(logprobs=21), "logprobs"),
        (cmp(logprobs=-1), "logprobs"),
        (cmp(seed=1 << 63), "seed"),
        (cmp(min_tokens=5, max_tokens=2), "min_tokens"),
        (cmp(logit_bias={str(vocab + rng.randint(0, 999)): 1}), "logit_bias"),
        (cmp(logit_bias={str(-rng.randint(1, 99)): 1}), "logit_bias"),
        (cmp(logit_bias={"abc": 1}), "logit_bias"),
        (cmp(logit_bias={"1.5": 1}), "logit_bias"),
        (cmp(logit_bias={"5": 100.5}), "logit_bias"),
        (cmp(logit_bias={"5": "1"}), "logit_bias"),
        (cmp(stop_token_ids=[vocab]), "stop_token_ids"),
        (cmp(stream_options={"include_usage": True}), "stream_options"),
        (cmp(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (cmp(max_tokens=0), "max_tokens"),  # 0 only with echo (the prompt's logprobs)
        (cmp(prompt_logprobs=21), "prompt_logprobs"),
        (cmp(suffix="tail"), "suffix"),
        (cmp(best_of=2), "best_of"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=False, top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(response_format={"type": "xml"}), "response_format"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
        (chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
        # Oversized: each bounded before any work is done for it.
        (cmp(logit_bias={str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
        (cmp(stop=["x" * (MAX_STOP_CHARS + rng.randint(1, 9999))]), "stop"),
        (cmp(stop_token_ids=[0] * (MAX_STOP_TOKEN_IDS + rng.randint(1, 99))), "stop_token_ids"),
        (cmp(prompt=[0] * rng.randint(512, 5000)), "prompt"),  # past the tiny model's context
        (chat(tools=[_TOOL] * (MAX_TOOLS + rng.randint(1, 99))), "tools"),
        (
            chat(chat_template_kwargs=_nested(MAX_JSON_DEPTH + rng.randint(0, 99))),
            "chat_template_kwargs",
        ),
        (cmp(guided_json=json.dumps(_nested(MAX_JSON_DEPTH + rng.randint(0, 99)))), "guided_json"),
        (chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages"),
        (chat(messages=[{"role": "user", "content": [{"type": "file", "file": {}}]}]), "messages"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, err = await call(http, path, body)
        check_error(status, err, 400, param, body)
    # NaN and infinities (Python's json writes and reads them).
    for v in ("NaN", "Infinity", "-Infinity"):
        raw = ('{"model":"tiny","prompt":"hi","temperature":' + v + "}").encode()
        status, err = await call(http, "/v1/completions", raw=raw)
        check_error(status, err, 400, "temperature", v)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _nested(depth: int) -> dict[str, Any]:
    x: Any = 1
    for i in range(depth):
        x = [x] if i % 2 else {"k": x}
    return {"x": x}


async def test_detokenize_takes_at_most_the_context(rng, http) -> None:
    status, body = await call(http, "/detokenize", {"tokens": [0] * rng.randint(513, 10_000)})
    check_error(status, body, 400, "tokens")


# ---- prompts and messages -------------------------------------------------------------------


async def test_prompt_forms(rng, http, vocab: int) -> None:
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
    bad_prompts = [
        ("", "empty"),
        ([""], "empty"),
        ([], "non-empty"),
        ([[]], "non-empty"),
        (None, "non-empty"),
        (rng.randint(0, 9), "non-empty"),
        ({"text": "hi"}, "non-empty"),
        ([*ids, vocab + rng.randint(0, 99)], "vocabulary"),
        ([*ids, -rng.randint(1, 99)], "vocabulary"),
        ([*ids, 1.5], "integer token ids"),
        ([True, *ids], "integer token ids"),
        (["a", 1], "integer token ids"),
        (["a", "b"], "batched"),
        ([ids, ids], "batched"),
    ]
    for prompt, words in bad_prompts:
        status, body = await call(http, "/v1/completions", cmp(prompt=prompt))
        check_error(status, body, 400, "prompt", prompt)
        assert words in body["error"]["message"], body
    status, body = await call(http, "/v1/completions", {"model": MODEL})
    check_error(status, body, 400, "prompt")
    # Token ids, and a batch of one, are one prompt.
    for prompt in (ids, [ids]):
        status, body = await call(http, "/v1/completions", cmp(prompt=prompt))
        assert status == 200 and body["usage"]["prompt_tokens"] == len(ids), body


async def test_prompt_past_the_context_is_400(http) -> None:
    words = " ".join("hello" for _ in range(random.randint(2000, 3000)))
    status, body = await call(http, "/v1/completions", cmp(prompt=words))
    check_error(status, body, 400, "prompt")
    assert "maximum context length" in body["error"]["message"]
    long_chat = chat(messages=[{"role": "user", "content": words}])
    status, body = await call(http, "/v1/chat/completions", long_chat)
    check_error(status, body, 400, "messages")


async def test_chat_messages(http) -> None:
    bad = [
        None,
        [],
        "hi",
        {"role": "user", "content": "hi"},
        ["hi"],
        [{"content": "hi"}],
        [{"role": 1, "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "hi"}}],
        [{"role": "user", "content": ["hi"]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ]
    for messages in bad:
        status, body = await call(http, "/v1/chat/completions", chat(messages=messages))
        check_error(status, body, 400, "messages", messages)
    status, body = await call(http, "/v1/chat/completions", {"model": MODEL, "prompt": "hi"})
    check_error(status, body, 400, "messages")


async def test_chat_unusual_but_valid(rng, http) -> None:
    words = [f"w{rng.randint(0, 999)}" for _ in range(rng.randint(2, 5))]
    text = " ".join(words)

    async def greedy(messages: Any, **kw: Any) -> dict[str, Any]:
        body = chat(messages=messages, temperature=0, max_tokens=4, ignore_eos=True, **kw)
        status, out = await call(http, "/v1/chat/completions", body)
        assert status == 200, out
        return out

    plain = await greedy([{"role": "user", "content": text}])
    # Text parts are the same conversation as the joined string.
    parts = [{"type": "text", "text": w} for w in " ".join(words).partition(" ")]
    split = await greedy([{"role": "user", "content": parts}])
    assert split["choices"][0]["message"] == plain["choices"][0]["message"]
    assert split["usage"] == plain["usage"]
    # Any role string reaches the template (vLLM allows custom roles); an assistant turn may
    # carry no content (tool calls only).
    for messages in (
        [{"role": "ipython", "content": text}],
        [{"role": "developer", "content": "be brief"}, {"role": "user", "content": text}],
        [
            {"role": "user", "content": text},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ],
        [{"role": "user", "content": "🦙 ñ 世界 \u200d " + text, "name": "x"}],
    ):
        await greedy(messages)
    # Tools are rendered by the template with tool_choice none; user/metadata are labels.
    # (tool_choice auto needs --enable-auto-tool-choice: tests/integration/test_tools_api.py.)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    await greedy(USER, tools=tools, tool_choice="none", user="u", metadata={"k": "v"}, store=False)


# ---- unusual but valid ----------------------------------------------------------------------


async def test_lenient_values_work(http) -> None:
    n_tok = random.randint(2, 5)
    base = cmp(max_tokens=n_tok, ignore_eos=True)
    for extra in (
        {"max_tokens": float(n_tok)},  # integral float
        {"temperature": None, "top_p": None, "stop": None, "seed": None, "logit_bias": None},
        {"ignore_eos": 1},  # 0/1 booleans
        {"stream": 0, "echo": 0},
        {"user": "someone", "best_of": 1, "suffix": None},
        {"stop": "", "logit_bias": {}, "stop_token_ids": []},
        {"response_format": None},
    ):
        status, body = await call(http, "/v1/completions", {**base, **extra})
        assert status == 200, (extra, body)
        assert body["usage"]["completion_tokens"] == n_tok, (extra, body)
    # A field the server does not understand is refused, never ignored.
    status, body = await call(http, "/v1/completions", {**base, "unknown_field": {"x": [1]}})
    assert status == 400 and body["error"]["param"] == "unknown_field", body
    # Without a model the served one answers (vLLM); stream=1 streams.
    status, body = await call(http, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and body["model"] == MODEL, body
    async with http.post("/v1/completions", json=cmp(stream=1)) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert (await r.read()).endswith(b"data: [DONE]\n\n")


async def test_seeds_stops_and_greedy_n(http) -> None:
    for seed in (-(1 << 63), (1 << 63) - 1, -random.randint(1, 10**9)):
        body = cmp(seed=seed, n=3, max_tokens=3, ignore_eos=True)
        status, a = await call(http, "/v1/completions", body)
        assert status == 200, a
        status, b = await call(http, "/v1/completions", body)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    # temperature 0 with n > 1: allowed, every choice is the greedy answer.
    n = random.randint(2, 4)
    status, body = await call(http, "/v1/completions", cmp(temperature=0, n=n, max_tokens=4))
    assert status == 200 and len({c["text"] for c in body["choices"]}) == 1, body
    # stop: a string, a list, more than OpenAI's 4, empty strings ignored.
    for stop in ("x", ["x", "y"], [chr(97 + i) for i in range(MAX_STOP_STRINGS)], ["", "z"]):
        status, body = await call(http, "/v1/completions", cmp(stop=stop))
        assert status == 200, (stop, body)


def test_openai_client(stack, tok) -> None:
    client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="unused", max_retries=0)
    special = set(tok.all_special_ids)
    favourite = random.choice([i for i in range(len(tok)) if i not in special])
    # The SDK sends logit_bias with string keys; +100 on one token makes it every answer.
    r = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=3,
        logit_bias={str(favourite): 100},
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tok.decode([favourite] * 3), (favourite, r)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
    assert e.value.body["param"] == "prompt" and "batched" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", stream_options={"include_usage": True})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "🦙 hi"}]}],
        max_tokens=2,
        seed=-5,
    )
    assert out.choices[0].finish_reason in ("length", "stop")


def test_stack_survived(stack) -> None:
    """Everything above left every service running and answering."""
    stack.check_alive()
    client = openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 2
