"""Request fields -> one structured-output constraint, and the 400s around it (gateway shape
checks; the renderer's xgrammar validation)."""

from __future__ import annotations

import json

import pytest
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.params import parse_chat, parse_completion
from voltserve.services.gateway.structured import parse_structured

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(
    "body,want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"type": "json_object", "value": None}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"type": "json", "value": json.dumps(SCHEMA)},
        ),
        ({"structured_outputs": {"json": SCHEMA}}, {"type": "json", "value": json.dumps(SCHEMA)}),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            {"type": "json", "value": json.dumps(SCHEMA)},
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"type": "regex", "value": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["a", "b"]}}, {"type": "choice", "value": ["a", "b"]}),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            {"type": "grammar", "value": 'root ::= "a"'},
        ),
        ({"structured_outputs": {"json_object": True}}, {"type": "json_object", "value": None}),
        (
            {"structured_outputs": {"regex": "a", "disable_fallback": True}},
            {"type": "regex", "value": "a"},
        ),
        (
            {"structured_outputs": {"regex": None, "choice": ["x"]}},
            {"type": "choice", "value": ["x"]},
        ),
        ({"guided_json": SCHEMA}, {"type": "json", "value": json.dumps(SCHEMA)}),
        ({"guided_regex": "a+"}, {"type": "regex", "value": "a+"}),
        ({"guided_choice": ["x", "y"]}, {"type": "choice", "value": ["x", "y"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"type": "grammar", "value": 'root ::= "a"'}),
        (
            {"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}}},
            {"type": "structural_tag", "value": '{"structures": [], "triggers": []}'},
        ),
    ],
)
def test_parse(body, want):
    assert parse_structured(body) == want


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"response_format": "json"}, "response_format", "object"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": SCHEMA, "bogus": 1},
                }
            },
            "response_format.json_schema",
            "bogus",
        ),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "unknown"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        (
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "only one",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "only one",
        ),
        ({"guided_choice": "a"}, "guided_choice", "list"),
        (
            {"guided_decoding_backend": "outlines", "guided_regex": "a"},
            "guided_decoding_backend",
            "xgrammar",
        ),
    ],
)
def test_refused(body, param, words):
    with pytest.raises(APIError) as e:
        parse_structured(body)
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message, e.value.message


def test_reaches_sampling_params_for_chat_and_completions():
    spec = parse_chat(chat(structured_outputs={"regex": "[0-9]"}), 384, 512)
    assert spec.params.structured == {"type": "regex", "value": "[0-9]"}
    spec = parse_completion({"prompt": "x", "guided_choice": ["a"]}, 384)
    assert spec.params.structured == {"type": "choice", "value": ["a"]}
    with pytest.raises(APIError) as e:
        parse_chat(chat(guided_regex="a", min_tokens=2), 384, 512)
    assert e.value.param == "min_tokens"


def test_renderer_validates_with_xgrammar():
    from voltserve.services.renderer.render import RenderFailed, check_constraint

    check_constraint({"type": "json", "value": json.dumps(SCHEMA)})
    for c, words in [
        ({"type": "regex", "value": "[a-"}, "regex"),
        ({"type": "json", "value": '{"type": "strin"}'}, "strin"),
        ({"type": "grammar", "value": "root ::= missing"}, "missing"),
        ({"type": "grammar", "value": 'start ::= "a"'}, "root"),
        ({"type": "structural_tag", "value": "[1]"}, "structural_tag"),
    ]:
        with pytest.raises(RenderFailed) as e:
            check_constraint(c)
        assert e.value.status == 400 and words in e.value.message, e.value.message
        assert "/project/" not in e.value.message and ".cc:" not in e.value.message
