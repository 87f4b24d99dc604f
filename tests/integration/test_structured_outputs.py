"""Structured outputs through the real services with the official openai client.

The tiny checkpoint has random weights, so whatever the output looks like is the constraint's
doing: at temperature 1.0 every parsed response must validate. Schemas bound every string
(maxLength), array (maxItems) and integer (minimum/maximum), so the grammar can always finish
well within max_tokens; a response cut by max_tokens ends with finish_reason "length" (and
openai's parse() raises LengthFinishReasonError for it).
"""

from __future__ import annotations

import json
import re
from enum import StrEnum

import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Describe a pet as JSON."}]


class Kind(StrEnum):
    cat = "cat"
    dog = "dog"
    fish = "fish"


class Owner(BaseModel):
    id: int = Field(ge=0, le=99)


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Kind
    tags: list[Kind] = Field(max_length=2)
    owner: Owner


# The tiny model's context is 512 tokens. Pet's grammar ends within this many whatever the
# model does: about 24 whitespace gaps of at most 12 characters (shared/structured.py) plus
# about 60 tokens of keys and values.
MAX_TOKENS = 460


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url() + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(stack):
    return AutoTokenizer.from_pretrained(stack.model)


@pytest.mark.parametrize("seed", [11, 12])
def test_parse_pydantic_at_temperature_1(client, seed):
    r = client.chat.completions.parse(
        model=MODEL,
        messages=MSGS,
        response_format=Pet,
        temperature=1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    pet = c.message.parsed
    assert isinstance(pet, Pet) and Pet.model_validate_json(c.message.content) == pet


def test_parse_streamed(client):
    with client.chat.completions.stream(
        model=MODEL,
        messages=MSGS,
        response_format=Pet,
        temperature=1.0,
        seed=21,
        max_tokens=MAX_TOKENS,
    ) as stream:
        pieces = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "stop"
    assert isinstance(c.message.parsed, Pet)
    assert len(pieces) > 1 and "".join(pieces) == c.message.content


def test_max_tokens_cuts_the_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, response_format=fmt, max_tokens=3, temperature=1.0, seed=1
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MSGS, response_format=Pet, max_tokens=3, seed=1
        )


def test_regex_and_choice(client):
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.message.content)
    choices = ["red", "green", "dark blue"]
    r = client.completions.create(
        model=MODEL,
        prompt="colour:",
        temperature=1.0,
        seed=4,
        n=4,
        max_tokens=20,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)


def test_json_object(client, tok):
    close = tok.convert_tokens_to_ids("}")
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format={"type": "json_object"},
        temperature=0.0,
        logit_bias={str(close): 100},  # close as soon as the grammar allows
        max_tokens=50,
    )
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == {}
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=9,
        max_tokens=120,
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


def test_grammar_streamed(client):
    ebnf = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        temperature=1.0,
        seed=5,
        max_tokens=60,
        stream=True,
        extra_body={"structured_outputs": {"grammar": ebnf}},
    )
    text, finish = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop" and re.fullmatch(r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)", text)


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"structured_outputs": {"regex": "[a-"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "nothing"),
        ({"structured_outputs": {"regexp": "a"}}, "unknown"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "only one"),
        ({"guided_json": {"type": "objekt"}}, "objekt"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ],
)
def test_bad_constraints_are_400(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and words in str(e.value), str(e.value)
