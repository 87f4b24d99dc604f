"""Responses and Messages requests -> the internal chat request (services/gateway/
responses_request.py, messages_request.py): what each item or block becomes, and that every
field or key this server does not implement is a 400 naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from voltserve.services.gateway.chat_bridge import prepare
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.messages_request import (
    ERROR_PREFIX,
    MESSAGES_FIELDS,
    parse_messages,
)
from voltserve.services.gateway.responses_request import RESPONSES_FIELDS, parse_responses

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


def _responses(body: dict, parser: bool = False):
    return parse_responses({"model": "m", **body}, parser)


def _messages(body: dict, parser: bool = False):
    return parse_messages({"model": "m", "max_tokens": 8, **body}, parser)


def _call(name: str, args: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def test_responses_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        # An earlier response's output, as the client sends it back.
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
            "status": "completed",
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
        # Calls with no message before them: an assistant turn of their own.
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "three"},
    ]
    req = _responses({"input": items, "instructions": "sys"})
    assert req.call.body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "reasoning_content": "think",
            "tool_calls": [_call("f", "{}", "c1"), _call("g", '{"x": 1}', "c2")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [_call("f", "{}", "c3")]},
        {"role": "tool", "tool_call_id": "c3", "content": "three"},
    ]


def test_responses_options_become_chat_options() -> None:
    tool = {"type": "function", "name": "f", "parameters": SCHEMA, "strict": True}
    req = _responses(
        {
            "input": "hi",
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
            "reasoning": {"effort": "none", "summary": "auto"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
            "stream": True,
        }
    )
    body = req.call.body
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False and body["max_tokens"] == 7
    assert (body["temperature"], body["top_p"]) == (0.5, 0.9)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": SCHEMA},
    }
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert req.stream and req.echo["tool_choice"] == {"type": "function", "name": "f"}
    assert _responses({"input": "hi", "reasoning": {"effort": "low"}}, parser=True).call.body[
        "chat_template_kwargs"
    ] == {"enable_thinking": True}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "seed": 1, "logit_bias": {}}, "logit_bias"),
        ({"input": [{"role": "user", "content": "a", "name": "bob"}]}, "input[0].name"),
        ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "y": 1}]},
            "input[0].y",
        ),
        (
            {
                "input": [
                    {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "input[0].encrypted_content",
        ),
        (
            {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}]},
            "input[0]",
        ),
        (
            {
                "input": [
                    {
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "x", "annotations": [{}]}],
                    }
                ]
            },
            "input[0].content[0].annotations",
        ),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "x": 1}]}, "tools[0].x"),
        ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            "tools[0].parameters",
        ),
        ({"input": "hi", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_object", "x": 1}}}, "text.format.x"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort"),  # no parser
        ({"input": "hi", "service_tier": "flex"}, "service_tier"),
        ({"input": "hi", "include": "x"}, "include"),
        ({"input": "hi", "user": 5}, "user"),
        ({"input": "hi", "max_output_tokens": True}, "max_output_tokens"),
        ({"input": 5}, "input"),
    ],
)
def test_responses_refusals_name_the_field(body, param) -> None:
    with pytest.raises(APIError) as e:
        _responses(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_messages_blocks_become_chat_messages() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Let me "},
                {"type": "text", "text": "see.", "citations": None},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "é"}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "boom"}],
                    "is_error": True,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "and "},
                {"type": "text", "text": "so?"},
            ],
        },
    ]
    req = _messages(
        {
            "system": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}],
            "messages": messages,
        }
    )
    assert req.call.body["messages"] == [
        {"role": "system", "content": "s1s2"},
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [_call("f", '{"q": "é"}', "t1"), _call("g", "{}", "t2")],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": ERROR_PREFIX + "boom"},
        {"role": "user", "content": "and so?"},
    ]


@pytest.mark.parametrize(
    "choice, chat_choice, parallel",
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, None),
        ({"type": "none"}, "none", None),
    ],
)
def test_messages_tool_choice(choice, chat_choice, parallel) -> None:
    tool = {"name": "f", "description": "d", "input_schema": SCHEMA, "cache_control": {}}
    body = _messages(
        {"messages": [{"role": "user", "content": "a"}], "tools": [tool], "tool_choice": choice}
    ).call.body
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "description": "d"}}
    ]
    assert body["tool_choice"] == chat_choice
    assert body.get("parallel_tool_calls") == (None if parallel is None else parallel)


def test_messages_options_become_chat_options() -> None:
    req = _messages(
        {
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 4096,
            "stop_sequences": ["\n\n", "END"],
            "temperature": 0.3,
            "top_p": 0.8,
            "top_k": 20,
            "thinking": {"type": "enabled", "budget_tokens": 2048, "display": "omitted"},
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
            "metadata": {"user_id": "u"},
            "stream": True,
        },
        parser=True,
    )
    body = req.call.body
    assert body["stop"] == ["\n\n", "END"] and body["max_tokens"] == 4096
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.3, 0.8, 20)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["response_format"]["json_schema"]["schema"] == SCHEMA
    assert req.stream and req.thinking_omitted
    off = _messages(
        {"messages": [{"role": "user", "content": "a"}], "thinking": {"type": "disabled"}}
    )
    assert off.call.body["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "a", "name": "x"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                    },
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content[0].input",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "y"}],
                    }
                ]
            },
            "messages[0].content[0].is_error",
        ),
        ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": "a"}], "system": [{"type": "image"}]},
            "system[0]",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"name": "f"}]},
            "tools[0].input_schema",
        ),
        (
            {
                "messages": [{"role": "user", "content": "a"}],
                "tool_choice": {"type": "auto", "name": "f"},
            },
            "tool_choice.name",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "some"}},
            "tool_choice.type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "a"}],
                "thinking": {"type": "enabled", "budget_tokens": 512},
            },
            "thinking.budget_tokens",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "top_p": -0.1}, "top_p"),
        (
            {"messages": [{"role": "user", "content": "a"}], "stop_sequences": [""]},
            "stop_sequences",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "metadata": {"x": 1}}, "metadata.x"),
        (
            {"messages": [{"role": "user", "content": "a"}], "service_tier": "priority"},
            "service_tier",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "container": "c"}, "container"),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": "8"}, "max_tokens"),
    ],
)
def test_messages_refusals_name_the_field(body, param) -> None:
    with pytest.raises(APIError) as e:
        _messages(body, parser=True)
    assert e.value.status == 400 and e.value.param == param, e.value.message


class _Gateway:
    """What prepare() reads of the gateway state."""

    class renderer:
        vocab_size = 100

    max_model_len = 64
    tooling = None


def test_chat_checks_run_on_the_translation() -> None:
    spec, plan = prepare(_Gateway(), _responses({"input": "hi", "max_output_tokens": 9}).call)  # type: ignore[arg-type]
    assert spec.params.max_tokens == 9 and spec.max_tokens_explicit and plan.plain
    # The chat route's own checks refuse what the translation let through.
    call = _messages(
        {"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "any"}}
    ).call
    with pytest.raises(APIError) as e:
        prepare(_Gateway(), call)  # type: ignore[arg-type]
    assert e.value.param == "tool_choice" and "tools" in e.value.message


def test_every_field_the_translations_read_is_listed() -> None:
    """A field a translation reads but its list lacks would be refused before it is read."""
    root = Path(__file__).parents[2] / "services" / "gateway"
    for name, known in (
        ("responses_request.py", RESPONSES_FIELDS),
        ("messages_request.py", MESSAGES_FIELDS),
    ):
        src = (root / name).read_text()
        read = set(re.findall(r'body\.get\("([a-z_]+)"', src))
        read |= set(re.findall(r'body\["([a-z_]+)"\]', src))
        assert read and not read - known, (name, read - known)


def test_image_inputs_are_refused_by_name() -> None:
    """An image part is a 400 that says image inputs are not served (a vision-language model
    such as Qwen3.5 serves its text part), in each API's spelling."""
    from voltserve.services.gateway.params import parse_chat

    image = "image inputs are not supported"
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    with pytest.raises(APIError, match=image) as e:
        parse_chat(chat, 1000, 100)
    assert e.value.param == "messages"
    part = {"type": "input_image", "image_url": "x"}
    with pytest.raises(APIError, match=image) as e:
        _responses({"input": [{"role": "user", "content": [part]}]})
    assert e.value.param == "input[0].content[0].type"
    block = {"type": "image", "source": {"type": "url", "url": "x"}}
    with pytest.raises(APIError, match=image):
        _messages({"messages": [{"role": "user", "content": [block]}]})
    # Not a media type: the plain refusal, without the note.
    with pytest.raises(APIError) as e:
        _responses({"input": [{"role": "user", "content": [{"type": "nope"}]}]})
    assert image not in str(e.value)
