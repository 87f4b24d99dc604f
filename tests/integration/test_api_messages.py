"""POST /v1/messages (Anthropic's Messages API) end to end with the official anthropic client
(client.messages.create / .stream), against the shared stack (the random-weight demo checkpoint,
a gateway without tool or reasoning parsers).

Greedy text must equal the chat route's for the same conversation, token counts included.
Tool calls are forced (tool_choice any / tool), so the random model still produces valid
tool_use blocks. Errors on this route come in Anthropic's shape."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

WORDS = "the sea is wide and deep and blue a small robot paints the city with light".split()
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
    "cache_control": {"type": "ephemeral"},
}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
# One forced call's grammar ends within this whatever the random model does: about 22 runs of
# whitespace of at most 12 tokens (shared/structured.py), plus about 30 tokens of keys and
# values; parallel calls are off where a call is forced, so the array holds one. (The tiny
# model's context is 512 tokens.)
CALL_TOKENS = 440
GREEDY = {"temperature": 0}  # the current SDK passes sampling fields as extra body fields


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url(), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="unused", max_retries=0)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "."


def _chat(chat_client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw):
    return chat_client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _content(message) -> list[tuple]:
    """A message's blocks as plain values (the SDK's stream helper builds Parsed* classes)."""
    return [
        (b.type, b.text) if b.type == "text" else (b.type, b.id, b.name, b.input)
        for b in message.content
    ]


def _check_usage(m, chat) -> None:
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens


_STOP = {"stop": "end_turn", "length": "max_tokens"}


def test_greedy_text_equals_chat(client, chat_client, rng) -> None:
    system, question = _sentence(rng), _sentence(rng)
    n = rng.randint(4, 24)
    chat = _chat(
        chat_client,
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        n,
    )
    m = client.messages.create(
        model="tiny",
        system=system,
        messages=[{"role": "user", "content": question}],
        max_tokens=n,
        extra_body=GREEDY,
    )
    text = chat.choices[0].message.content
    assert _text(m) == text
    assert [b.type for b in m.content] == (["text"] if text else [])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "tiny" and m.stop_sequence is None
    assert m.stop_reason == _STOP[chat.choices[0].finish_reason]
    _check_usage(m, chat)


def test_blocks_and_system_blocks_equal_chat(client, chat_client, rng) -> None:
    turns = [_sentence(rng) for _ in range(5)]
    chat = _chat(
        chat_client,
        [
            {"role": "system", "content": turns[0] + turns[1]},
            {"role": "user", "content": turns[2]},
            {"role": "assistant", "content": turns[3]},
            {"role": "user", "content": turns[4]},
        ],
        10,
    )
    m = client.messages.create(
        model="tiny",
        system=[
            {"type": "text", "text": turns[0]},
            {"type": "text", "text": turns[1], "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": turns[2]}]},
            {"role": "assistant", "content": [{"type": "text", "text": turns[3]}]},
            {"role": "user", "content": turns[4]},
        ],
        max_tokens=10,
        extra_body=GREEDY,
    )
    assert _text(m) == chat.choices[0].message.content
    _check_usage(m, chat)


def test_stream_events_and_text(client, rng) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": _sentence(rng)}],
        max_tokens=rng.randint(4, 24),
        extra_body=GREEDY,
    )
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    text = _text(whole)
    body = []
    if text:
        deltas = [e for e in events if e.type == "content_block_delta"]
        assert all(e.index == 0 and e.delta.type == "text_delta" for e in deltas)
        assert "".join(e.delta.text for e in deltas) == text
        body = ["content_block_start", *["content_block_delta"] * len(deltas), "content_block_stop"]
        assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert types == ["message_start", *body, "message_delta", "message_stop"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None

    # The stream's prompt comes from the prefix cache (the same prompt ran just before).
    def prompt_tokens(u) -> int:
        return u.input_tokens + u.cache_read_input_tokens

    assert prompt_tokens(start.usage) == prompt_tokens(whole.usage)
    assert start.usage.cache_read_input_tokens > 0
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # The SDK's helper accumulates the same message.
    with client.messages.stream(**kw) as s:
        assert "".join(s.text_stream) == text
        final = s.get_final_message()
    assert _content(final) == _content(whole) and final.stop_reason == whole.stop_reason


def test_stop_sequences(client, chat_client, rng) -> None:
    # A conversation whose greedy answer is long enough to cut (the random model ends at once
    # on few prompts, if any).
    for _ in range(20):
        question = _sentence(rng)
        full = _chat(chat_client, [{"role": "user", "content": question}], 16)
        text = full.choices[0].message.content
        if len(text) >= 3:
            break
    else:
        pytest.fail("20 prompts drawn, every greedy answer shorter than 3 characters")
    i = rng.randrange(len(text) - 2)
    stop = text[i : i + rng.randint(1, 2)]
    expected = text[: text.find(stop)]
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        stop_sequences=[stop],
        extra_body=GREEDY,
    )
    m = client.messages.create(**kw)
    assert _text(m) == expected
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert _text(final) == expected
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def _check_tool_uses(m) -> list:
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use", m.content
    for b in uses:
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


def test_tool_use_round_trip(client, chat_client, rng) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(
        model="tiny",
        messages=ask,
        tools=[WEATHER, TIME],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=CALL_TOKENS,
        extra_body={"temperature": 1.0},
    )
    uses = _check_tool_uses(m)
    assert all(b.id.startswith("call_") for b in uses)
    results = [f"result {i}: {_sentence(rng)}" for i in range(len(uses))]
    error = rng.randrange(len(uses))  # one failed call: the model is told so
    messages = ask + [
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": b.id,
                    "content": [{"type": "text", "text": r}] if i % 2 else r,
                    **({"is_error": True} if i == error else {}),
                }
                for i, (b, r) in enumerate(zip(uses, results))
            ],
        },
    ]
    second = client.messages.create(
        model="tiny",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice={"type": "none"},
        max_tokens=12,
        extra_body=GREEDY,
    )
    chat_msgs = ask + [
        {
            "role": "assistant",
            "content": _text(m),
            "tool_calls": [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in uses
            ],
        }
    ]
    chat_msgs += [
        {"role": "tool", "tool_call_id": b.id, "content": ("Error: " if i == error else "") + r}
        for i, (b, r) in enumerate(zip(uses, results))
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "parameters": t["input_schema"]}
            | ({"description": t["description"]} if "description" in t else {}),
        }
        for t in (WEATHER, TIME)
    ]
    chat = _chat(chat_client, chat_msgs, 12, tools=tools, tool_choice="none")
    assert _text(second) == chat.choices[0].message.content
    assert all(b.type == "text" for b in second.content)
    _check_usage(second, chat)


def test_named_tool_streams_input_json(client) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        max_tokens=CALL_TOKENS,
        extra_body=GREEDY,
    )
    whole = client.messages.create(**kw)
    [use] = _check_tool_uses(whole)
    assert use.name == "get_time"
    events = list(client.messages.create(stream=True, **kw))
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    block = events[1].content_block
    assert (block.type, block.name, block.input) == ("tool_use", "get_time", {})
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == use.input
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_time", use.input)
    ]


def _post(stack, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        stack.base_url() + "/v1/messages",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, name",
    [
        ({"messages": HI}, "max_tokens"),
        ({"messages": HI, "max_tokens": 4, "frobnicate": 1}, "frobnicate"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "max_tokens": 100_000}, "maximum context length"),
        ({"messages": HI, "max_tokens": 4, "temperature": 1.5}, "temperature"),
        ({"messages": HI, "max_tokens": 4, "top_k": 0}, "top_k"),
        ({"messages": HI, "max_tokens": 4, "stop_sequences": ["x"] * 17}, "stop_sequences"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}
                ],
                "max_tokens": 4,
            },
            "messages[0].content[0].type",
        ),
        ({"messages": HI + [{"role": "assistant", "content": "Sure"}], "max_tokens": 4}, "prefill"),
        ({"messages": HI, "max_tokens": 4, "tools": [{"type": "bash_20250124"}]}, "tools[0].type"),
        ({"messages": HI, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": HI, "max_tokens": 4, "tools": [WEATHER]}, "--enable-auto-tool-choice"),
        (
            {"messages": HI, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool"}},
            "tool_choice.name",
        ),
        (
            {
                "messages": HI,
                "max_tokens": 2048,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "--reasoning-parser",
        ),
        ({"messages": HI, "max_tokens": 4, "metadata": {"user_id": 5}}, "metadata.user_id"),
        (
            {"messages": HI, "max_tokens": 4, "output_config": {"effort": "high"}},
            "output_config.effort",
        ),
    ],
)
def test_errors_in_anthropic_shape(stack, client, body, name) -> None:
    status, err = _post(stack, {"model": "tiny", **body})
    assert status == 400
    assert err["type"] == "error" and set(err) == {"type", "error"}
    assert err["error"]["type"] == "invalid_request_error"
    assert name in err["error"]["message"], err
    # The SDK reads it as Anthropic's error.
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": "tiny", **body}, cast_to=object)
    assert e.value.body == err


def test_unknown_model_and_json_schema_output(stack, client, rng) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", messages=HI, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    status, err = _post(stack, {"model": "tiny", "messages": "x", "max_tokens": 4})
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    schema = {
        "type": "object",
        "properties": {
            "zone": {"type": "string", "enum": ["UTC", "CET"]},
            "ok": {"type": "boolean"},
        },
        "required": ["zone", "ok"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model="tiny",
        messages=HI,
        max_tokens=CALL_TOKENS,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 1.0},
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(m)), schema)
