"""POST /v1/responses end to end with the official openai client (client.responses), against the
shared stack (the random-weight demo checkpoint, a gateway without tool or reasoning parsers).

Greedy text must equal the chat route's for the same conversation, token counts included: the
translation to the internal chat request is then the same prompt. Tool calls are forced
(tool_choice required or a named function) and schemas constrain the output, so the random
model still produces valid calls and JSON."""

from __future__ import annotations

import json
import random
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

WORDS = "the sea is wide and deep and blue a small robot paints the city with light".split()
WEATHER = {
    "type": "function",
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
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}

# One forced call's grammar ends within this whatever the random model does: about 22 runs of
# whitespace of at most 12 tokens (shared/structured.py), plus about 30 tokens of keys and
# values; parallel calls are off where a call is forced, so the array holds one. (The tiny
# model's context is 512 tokens.)
CALL_TOKENS = 440


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="unused", max_retries=0)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "."


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def _check_usage(r, chat) -> None:
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def _status(finish_reason: str) -> str:
    return {"stop": "completed", "length": "incomplete"}[finish_reason]


def test_greedy_text_equals_chat(client, rng) -> None:
    system, question = _sentence(rng), _sentence(rng)
    n = rng.randint(4, 24)
    chat = _chat(
        client, [{"role": "system", "content": system}, {"role": "user", "content": question}], n
    )
    r = client.responses.create(
        model="tiny", instructions=system, input=question, temperature=0, max_output_tokens=n
    )
    text = chat.choices[0].message.content
    assert r.output_text == text
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == _status(chat.choices[0].finish_reason)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    if text:
        [msg] = r.output
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [p.type for p in msg.content] == ["output_text"]
    else:
        assert r.output == []
    _check_usage(r, chat)
    assert r.store is False and r.previous_response_id is None


def test_multi_turn_items_equal_chat(client, rng) -> None:
    turns = [_sentence(rng) for _ in range(4)]
    messages = [
        {"role": "developer", "content": turns[0]},
        {"role": "user", "content": turns[1]},
        {"role": "assistant", "content": turns[2]},
        {"role": "user", "content": turns[3]},
    ]
    chat_msgs = [
        {**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages
    ]
    chat = _chat(client, chat_msgs, 10)
    items = [
        {"type": "message", "role": "developer", "content": turns[0]},
        {"role": "user", "content": [{"type": "input_text", "text": turns[1]}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": turns[2], "annotations": []}],
        },
        {"role": "user", "content": turns[3]},
    ]
    r = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=10)
    assert r.output_text == chat.choices[0].message.content
    _check_usage(r, chat)


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_stream_events_and_text(client, rng) -> None:
    question = _sentence(rng)
    n = rng.randint(4, 24)
    whole = client.responses.create(
        model="tiny", input=question, temperature=0, max_output_tokens=n
    )
    events = _events(
        client.responses.create(
            model="tiny", input=question, temperature=0, max_output_tokens=n, stream=True
        )
    )
    types = [e.type for e in events]
    final = events[-1]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert final.type == f"response.{whole.status}"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    if whole.output_text:
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert "".join(e.delta for e in deltas) == whole.output_text
        body = ["response.output_text.delta"] * len(deltas)
        assert types[2:-1] == [
            "response.output_item.added",
            "response.content_part.added",
            *body,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        item_id = events[2].item.id
        assert all(e.item_id == item_id for e in deltas)
        assert events[-2].item.content[0].text == whole.output_text
    assert final.response.output_text == whole.output_text
    assert final.response.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulator checks the order of the events too. (It makes a final response
    # of response.completed only, not of response.incomplete.)
    with client.responses.stream(
        model="tiny", input=question, temperature=0, max_output_tokens=n
    ) as s:
        events = list(s)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text
        assert events[-1].type == f"response.{whole.status}"
        if whole.status == "completed":
            assert s.get_final_response().output_text == whole.output_text


def _validate(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, {"get_weather": WEATHER, "get_time": TIME}[name]["parameters"])
    return args


def test_function_call_round_trip(client, rng) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(
        model="tiny",
        input=ask,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        top_p=0.9,
        max_output_tokens=CALL_TOKENS,
        extra_body={"seed": rng.randrange(1 << 30)},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and len(calls) == len(r.output)
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_")
        assert c.status == "completed"
        _validate(c.name, c.arguments)
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    # The client sends the calls back with their outputs; the answer is the chat route's for the
    # same conversation (tool_choice none: this gateway has no tool parser for auto).
    outputs = [f"result {i}: {_sentence(rng)}" for i in range(len(calls))]
    items = ask + [c.model_dump(exclude_unset=True) for c in calls]
    items += [
        {"type": "function_call_output", "call_id": c.call_id, "output": o}
        for c, o in zip(calls, outputs)
    ]
    second = client.responses.create(
        model="tiny",
        input=items,
        tools=[WEATHER, TIME],
        tool_choice="none",
        temperature=0,
        max_output_tokens=12,
    )
    chat_msgs = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ],
        }
    ]
    chat_msgs += [
        {"role": "tool", "tool_call_id": c.call_id, "content": o} for c, o in zip(calls, outputs)
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in (WEATHER, TIME)
    ]
    chat = _chat(client, chat_msgs, 12, tools=chat_tools, tool_choice="none")
    assert second.output_text == chat.choices[0].message.content
    _check_usage(second, chat)
    assert all(o.type == "message" for o in second.output)


def test_named_function_streams_its_arguments(client, rng) -> None:
    kw = dict(
        model="tiny",
        input="What time is it?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=1.0,
        max_output_tokens=CALL_TOKENS,
        extra_body={"seed": rng.randrange(1 << 30)},
    )
    whole = client.responses.create(**kw)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_time"
    _validate("get_time", call.arguments)
    events = _events(client.responses.create(stream=True, **kw))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.delta for e in deltas) == done.arguments == call.arguments
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.item.type, e.item.name, e.item.arguments) for e in added] == [
        ("function_call", "get_time", "")
    ]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: Literal[0, 2, 4]
    indoor: bool


def test_text_format_json_schema_is_parsed(client, rng) -> None:
    r = client.responses.parse(
        model="tiny",
        input="Describe a pet as JSON.",
        text_format=Pet,
        temperature=1.0,
        max_output_tokens=CALL_TOKENS,
        extra_body={"seed": rng.randrange(1 << 30)},
    )
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, Pet)
    assert Pet.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema"
    # json_object: any JSON object.
    r = client.responses.create(
        model="tiny",
        input="Any JSON object.",
        text={"format": {"type": "json_object"}},
        temperature=1.0,
        max_output_tokens=CALL_TOKENS,
        extra_body={"seed": rng.randrange(1 << 30)},
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:  # an unbounded object may run past the limit: cut, never invalid so far
        assert r.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs the parser flags
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # no reasoning parser here
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "user", "content": "hi", "extra": 1}]}, "input[0].extra"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": []}, "input"),
        # Refused by the renderer, named the Responses way.
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text.format",
        ),
    ],
)
def test_bad_requests_name_the_field(client, extra, param) -> None:
    body = {"model": "tiny", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{k: body.pop(k) for k in ("model", "input")}, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.status_code == 400


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
