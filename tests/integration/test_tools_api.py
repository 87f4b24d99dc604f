"""Tool calling and reasoning output end to end, with the official openai client, against a
stack serving tests/scripted_model.py (a model whose weights make it say scripted replies):
gateway-0 runs `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`,
gateway-1 runs without those flags."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest
from voltserve.services.gateway.tools import HAS_STRUCTURED

from tests.scripted_model import piece_id, scripted_checkpoint

from .conftest import Stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("tools")
    model = scripted_checkpoint(str(work))
    s = Stack(model, work)
    try:
        s.add_scheduler()
        s.add_renderer()
        s.add_executor()
        s.add_gateway(
            "gateway-0",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        )
        s.add_gateway("gateway-1")
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def plain_client(stack) -> openai.OpenAI:
    url = stack.base_url("gateway-1") + "/v1"
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def bias(stack, piece: str) -> dict[str, int]:
    """A logit bias that picks the scripted reply starting with `piece`."""
    return {str(piece_id(Path(stack.model), piece)): 100}


def collect(stream) -> tuple[str, str, list[dict], list[str | None]]:
    """(content, reasoning, tool calls, finish reasons) put together from stream chunks."""
    content, reasoning, calls, finish = "", "", [], []
    for ch in stream:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index == len(calls):
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                else:
                    assert tc.index < len(calls) and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                finish.append(c.finish_reason)
    return content, reasoning, calls, finish


def test_auto_tool_call_is_parsed(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=20
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # Streamed: the same pieces, the name first, the arguments in pieces after it.
    s = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=0,
        max_tokens=20,
        stream=True,
    )
    content, reasoning, calls, finish = collect(s)
    assert content == "Let me check." and reasoning == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert finish == ["tool_calls"]


def test_tool_choice_none_leaves_the_text(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0
    )
    m = r.choices[0].message
    assert not m.tool_calls and r.choices[0].finish_reason == "stop"
    assert m.content.startswith("Let me check.<tool_call>") and '"Paris"' in m.content


def test_round_trip_with_a_tool_result(stack, client) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], temperature=0
    )
    m = first.choices[0].message
    call = m.tool_calls[0]
    messages = ASK + [
        {
            "role": "assistant",
            "content": m.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[WEATHER],
        temperature=0,
        logit_bias=bias(stack, "It is sunny in Paris."),
    )
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    # What the template was given: the tools, the call with its arguments as an object (not
    # a quoted string), the tool's answer in Qwen's tool_response block.
    req = urllib.request.Request(
        stack.base_url() + "/tokenize",
        data=json.dumps(
            {"messages": messages, "chat_template_kwargs": {"tools": [WEATHER]}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as resp:
        ids = json.loads(resp.read())["tokens"]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(stack.model).decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>" in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_reasoning_split(stack, client) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        logit_bias=bias(stack, "<think>"),
    )
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "\nThe user greets me.\n"
    assert m.content == "Hello there!"
    content, reasoning, calls, finish = collect(client.chat.completions.create(stream=True, **kw))
    assert (content, reasoning, calls, finish) == (
        "Hello there!",
        "\nThe user greets me.\n",
        [],
        ["stop"],
    )
    # With tools, reasoning and tool parsing compose: a reply without <think> is all content.
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0)
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_enable_thinking_reaches_the_template(stack) -> None:
    def prompt(kwargs):
        body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
        req = urllib.request.Request(
            stack.base_url() + "/tokenize",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())["tokens"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    assert tok.decode(prompt({"enable_thinking": False})).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(prompt({})).endswith("<|im_start|>assistant\n")


def test_auto_needs_the_flags(plain_client) -> None:
    # As vLLM: tools with tool_choice auto (the default with tools) is refused without the
    # parser flags, never served as if the tools were not there.
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            plain_client.chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER], **extra
            )
        assert "--enable-auto-tool-choice" in str(e.value)
    r = plain_client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    bad = [
        {"tool_choice": "required"},  # no tools
        {"tools": [{"type": "function", "function": {}}]},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": "yes"},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            plain_client.chat.completions.create(model="tiny", messages=ASK, **extra)


needs_structured = pytest.mark.skipif(
    not HAS_STRUCTURED,
    reason="tool_choice required/named are enforced with structured outputs "
    "(SamplingParams.structured), which this build does not have yet",
)


def _validate(call_name: str, arguments: str) -> None:
    schema = {"get_weather": WEATHER, "get_time": TIME}[call_name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def _calls(cl, stream: bool, **kw) -> list[tuple[str | None, list[list[str]], str | None]]:
    """Per choice: (reasoning, [[name, arguments]], finish reason), streamed or not."""
    if not stream:
        r = cl.chat.completions.create(**kw)
        return [
            (
                ch.message.model_extra.get("reasoning_content"),
                [[c.function.name, c.function.arguments] for c in ch.message.tool_calls or []],
                ch.finish_reason,
            )
            for ch in r.choices
        ]
    per: dict[int, list] = {}
    for chunk in cl.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            got = per.setdefault(ch.index, [None, [], None])
            r = (ch.delta.model_extra or {}).get("reasoning_content")
            if r:
                got[0] = (got[0] or "") + r
            for tc in ch.delta.tool_calls or []:
                if tc.index == len(got[1]):
                    got[1].append([tc.function.name, ""])
                got[1][tc.index][1] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                got[2] = ch.finish_reason
    return [tuple(per[i]) for i in sorted(per)]


@needs_structured
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_always_call(stack, client, plain_client, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    # The constraint alone shapes these outputs (the scripted model has no opinion on JSON
    # tokens): a random walk through the grammar, whitespace included, needs room to end.
    base = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], n=2, max_tokens=400)
    cases = []
    for c, (choice, name) in enumerate([("required", None), (named, "get_time")]):
        for cl in (client, plain_client):  # no parser flags needed for these
            cases.append((cl, choice, name, dict(temperature=1.0, seed=17 + c), None))
        # Reasoning first, then the constrained call: the constraint starts after </think>.
        think = dict(
            temperature=1.0,
            seed=5 + c,
            logit_bias=bias(stack, "<think>"),
            parallel_tool_calls=False,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        cases.append((client, choice, name, think, "\nThe user greets me.\n"))
    for cl, choice, name, kw, reasoning in cases:
        got = _calls(cl, stream, tool_choice=choice, **base, **kw)
        assert len(got) == 2
        for r, calls, finish in got:
            where = (choice, kw, r, calls, finish)
            assert calls, where
            for call_name, args in calls:
                assert name is None or call_name == name, where
                _validate(call_name, args)
            assert finish == ("tool_calls" if name is None else "stop"), where
            if reasoning is not None:
                assert r == reasoning, where
