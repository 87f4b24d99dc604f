"""Reasoning and tool calls parsed out of free text, through /v1/responses and /v1/messages with
the official openai and anthropic clients. The stack serves a scripted checkpoint
(tests/scripted_model.py) whose reply is reasoning, then text, then a hermes tool call; its
gateway runs `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
--api-key KEY`, so the clients authenticate the way each sends its key (openai:
`Authorization: Bearer`, anthropic: `x-api-key`)."""

from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

from tests.scripted_model import scripted_checkpoint

from .conftest import Stack

KEY = "key-for-the-protocol-tests"
REASONING = "\nThe user asks about the weather.\n"
CALL = {"city": "Paris", "days": 3}
REPLY = (
    "<think>",
    REASONING,
    "</think>",
    "\n\nLet me check.",
    "<tool_call>",
    "\n" + json.dumps({"name": "get_weather", "arguments": CALL}) + "\n",
    "</tool_call>",
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("protocols")
    s = Stack(scripted_checkpoint(str(work), (REPLY,)), work)
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
            "--api-key",
            KEY,
        )
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def ant(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url(), api_key=KEY, max_retries=0)


def _prompt_tokens(oai: openai.OpenAI, messages: list[dict], tools: list[dict]) -> int:
    chat = oai.chat.completions.create(
        model="tiny", messages=messages, tools=tools, tool_choice="none", max_tokens=1
    )
    return chat.usage.prompt_tokens


# ---- Responses ------------------------------------------------------------------------------

R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True},
    }
]


def _items(r) -> list[tuple]:
    out = []
    for o in r.output:
        if o.type == "reasoning":
            out.append(("reasoning", [(c.type, c.text) for c in o.content], o.summary))
        elif o.type == "message":
            out.append(("message", [(c.type, c.text) for c in o.content], o.status))
        else:
            out.append(("function_call", o.name, json.loads(o.arguments), o.status))
    return out


EXPECTED_ITEMS = [
    ("reasoning", [("reasoning_text", REASONING)], []),
    ("message", [("output_text", "Let me check.")], "completed"),
    ("function_call", "get_weather", CALL, "completed"),
]


def test_responses_reasoning_text_and_call(oai) -> None:
    r = oai.responses.create(model="tiny", input=ASK, tools=R_TOOLS, temperature=0)
    assert r.status == "completed"
    assert _items(r) == EXPECTED_ITEMS
    assert r.output_text == "Let me check."
    assert r.output[0].id.startswith("rs_") and r.output[2].call_id.startswith("call_")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_responses_stream_items_in_order(oai) -> None:
    events = list(
        oai.responses.create(model="tiny", input=ASK, tools=R_TOOLS, temperature=0, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Runs of deltas collapsed: the event grammar of each item.
    kinds: list[str] = []
    for e in events:
        if not (kinds and e.type.endswith(".delta") and kinds[-1] == e.type):
            kinds.append(e.type)
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert reasoning == REASONING and json.loads(args) == CALL
    assert _items(events[-1].response) == EXPECTED_ITEMS
    with oai.responses.stream(model="tiny", input=ASK, tools=R_TOOLS, temperature=0) as s:
        assert _items(s.get_final_response()) == EXPECTED_ITEMS


def test_responses_round_trip_sends_the_items_back(oai, rng: random.Random) -> None:
    r = oai.responses.create(model="tiny", input=ASK, tools=R_TOOLS, temperature=0)
    call = r.output[2]
    result = f"sunny, {rng.randint(-5, 35)} C"
    items = ASK + [o.model_dump(exclude_unset=True) for o in r.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    second = oai.responses.create(
        model="tiny", input=items, tools=R_TOOLS, temperature=0, max_output_tokens=40
    )
    assert _items(second) == EXPECTED_ITEMS  # the scripted model says its one reply again
    # The prompt is the chat route's for the same conversation.
    chat = ASK + [
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": REASONING,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    assert second.usage.input_tokens == _prompt_tokens(oai, chat, CHAT_TOOLS)


# ---- Messages -------------------------------------------------------------------------------

A_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
A_CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": SCHEMA, "description": "Weather"},
    }
]


def _blocks(m) -> list[tuple]:
    out = []
    for b in m.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input))
    return out


EXPECTED_BLOCKS = [
    ("thinking", REASONING, ""),
    ("text", "Let me check."),
    ("tool_use", "get_weather", CALL),
]


def test_messages_thinking_text_and_tool_use(ant) -> None:
    m = ant.messages.create(model="tiny", messages=ASK, tools=A_TOOLS, max_tokens=64)
    assert _blocks(m) == EXPECTED_BLOCKS
    assert m.stop_reason == "tool_use" and m.content[2].id.startswith("call_")
    events = list(
        ant.messages.create(model="tiny", messages=ASK, tools=A_TOOLS, max_tokens=64, stream=True)
    )
    kinds: list[tuple] = []
    for e in events:
        k = (e.type, e.delta.type) if e.type == "content_block_delta" else (e.type,)
        if not (kinds and kinds[-1] == k and e.type == "content_block_delta"):
            kinds.append(k)
    assert kinds == [
        ("message_start",),
        ("content_block_start",),
        ("content_block_delta", "thinking_delta"),
        ("content_block_stop",),
        ("content_block_start",),
        ("content_block_delta", "text_delta"),
        ("content_block_stop",),
        ("content_block_start",),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop",),
        ("message_delta",),
        ("message_stop",),
    ]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert events[-2].delta.stop_reason == "tool_use"
    with ant.messages.stream(model="tiny", messages=ASK, tools=A_TOOLS, max_tokens=64) as s:
        final = s.get_final_message()
    assert _blocks(final) == EXPECTED_BLOCKS


def test_messages_thinking_omitted(ant) -> None:
    kw = dict(
        model="tiny",
        messages=ASK,
        tools=A_TOOLS,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
    )
    m = ant.messages.create(**kw)
    assert _blocks(m) == [("thinking", "", "")] + EXPECTED_BLOCKS[1:]
    events = list(ant.messages.create(stream=True, **kw))
    assert not [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    ]


def test_messages_round_trip_sends_the_blocks_back(oai, ant, rng: random.Random) -> None:
    m = ant.messages.create(model="tiny", messages=ASK, tools=A_TOOLS, max_tokens=64)
    use = m.content[2]
    result = f"sunny, {rng.randint(-5, 35)} C"
    messages = ASK + [
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}],
        },
    ]
    second = ant.messages.create(model="tiny", messages=messages, tools=A_TOOLS, max_tokens=64)
    assert _blocks(second) == EXPECTED_BLOCKS
    chat = ASK + [
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": REASONING,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(CALL)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": result},
    ]
    u = second.usage
    assert u.input_tokens + u.cache_read_input_tokens == _prompt_tokens(oai, chat, A_CHAT_TOOLS)


def test_api_key_either_header(stack) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(
            base_url=stack.base_url(), api_key="wrong", max_retries=0
        ).messages.create(model="tiny", messages=ASK, max_tokens=4)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=stack.base_url() + "/v1", api_key="wrong", max_retries=0
        ).responses.create(model="tiny", input="hi")
    # Anthropic's client with a bearer token (auth_token) is let in as well.
    bearer = anthropic.Anthropic(base_url=stack.base_url(), auth_token=KEY, max_retries=0)
    m = bearer.messages.create(model="tiny", messages=ASK, tools=A_TOOLS, max_tokens=64)
    assert _blocks(m) == EXPECTED_BLOCKS
