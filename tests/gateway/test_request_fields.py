"""Request fields an endpoint does not understand are refused with a 400 naming them, never
silently ignored; every field the parsers read is on the endpoint's list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.params import parse_chat, parse_completion
from voltserve.services.gateway.request_fields import CHAT_FIELDS, COMPLETION_FIELDS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _chat(body):
    return parse_chat(body, vocab_size=100, max_model_len=64)


def _completion(body):
    return parse_completion(body, vocab_size=100)


@pytest.mark.parametrize(
    "parse, base, field",
    [
        (_chat, CHAT, "reasoning_effort"),
        (_chat, CHAT, "functions"),
        (_chat, CHAT, "echo"),  # a completions field, not a chat one
        (_chat, CHAT, "include_stop_str_in_output"),
        (_completion, COMPLETION, "messages"),
        (_completion, COMPLETION, "max_completion_tokens"),
        (_completion, COMPLETION, "truncate_prompt_tokens"),
    ],
)
def test_unknown_field_is_a_400_naming_it(parse, base, field):
    with pytest.raises(APIError) as e:
        parse({**base, field: 1})
    assert e.value.status == 400
    assert e.value.param == field
    assert field in str(e.value)


def test_store_true_is_refused_and_false_accepted():
    with pytest.raises(APIError) as e:
        _chat({**CHAT, "store": True})
    assert e.value.param == "store"
    _chat({**CHAT, "store": False, "metadata": {"k": "v"}})


@pytest.mark.parametrize(
    "field, value", [("user", 5), ("user", ["a"]), ("metadata", "x"), ("metadata", {"k": 1})]
)
def test_malformed_labels_are_refused(field, value):
    with pytest.raises(APIError) as e:
        _chat({**CHAT, field: value})
    assert e.value.status == 400 and e.value.param == field
    with pytest.raises(APIError) as e:
        _completion({**COMPLETION, "user": 5})
    assert e.value.param == "user"


def test_several_unknown_fields_are_all_named():
    with pytest.raises(APIError) as e:
        _chat({**CHAT, "zeta": 1, "alpha": 2})
    assert e.value.param == "alpha"
    assert "zeta" in str(e.value)


def test_known_extensions_are_accepted():
    spec = _chat(
        {
            **CHAT,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "stop_token_ids": [3],
            "skip_special_tokens": False,
            "user": "someone",
            "max_completion_tokens": 4,
        }
    )
    assert spec.params.top_k == 5 and spec.params.max_tokens == 4
    spec = _completion({**COMPLETION, "echo": True, "max_tokens": 3, "prompt_logprobs": 1})
    assert spec.echo and spec.params.prompt_logprobs == 1


def test_every_field_the_parsers_read_is_listed():
    """A field a parser reads but the list lacks would be refused before it is read."""
    src = "".join(
        (Path(__file__).parents[2] / "services" / "gateway" / f).read_text()
        for f in ("params.py", "structured.py", "tools.py")
    )
    read = set(re.findall(r'(?:_get|get)\(\s*body,\s*"([a-z_]+)"', src))
    read |= set(re.findall(r'body\.get\("([a-z_]+)"', src))
    missing = read - (CHAT_FIELDS | COMPLETION_FIELDS)
    assert read and not missing, missing
