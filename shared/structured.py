"""Structured-output constraints: the `SamplingParams.structured` value and its grammar.

A constraint is a plain dict that travels with the sampling parameters:

    {"type": "json", "value": "<JSON schema as a JSON string>"}
    {"type": "json_object", "value": None}          any JSON object
    {"type": "regex", "value": "<pattern>"}
    {"type": "choice", "value": ["a", "b", ...]}    exactly one of the strings
    {"type": "grammar", "value": "<EBNF>"}          xgrammar's EBNF dialect, start rule `root`
    {"type": "structural_tag", "value": "<JSON>"}   vLLM's / xgrammar's structural tag format

The grammar engine is xgrammar. `check_shape` needs nothing but Python (the gateway and the
SamplingParams validation call it); `to_grammar` and `compile_with` import xgrammar, so only the
renderer (validation: an invalid schema, regex or grammar is a 400 naming the problem before the
request reaches an engine) and the executor (compilation against the model's vocabulary) load it.
"""

from __future__ import annotations

import json
import re
from typing import Any

TYPES = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# JSON whitespace: free, as in vLLM (models pretty-print), but each run is bounded so that a
# constrained generation cannot spend its whole budget on whitespace between two tokens.
ANY_WHITESPACE = True
MAX_WHITESPACE_RUN = 12

# Strings longer than this are refused at the gateway (a constraint is compiled per request).
MAX_CONSTRAINT_CHARS = 1 << 20


class ConstraintError(ValueError):
    """A constraint xgrammar cannot build; the message names the problem (no C++ file names)."""


def check_shape(c: Any) -> None:
    """Raise ValueError unless c is a well-formed constraint dict (shape only, no grammar)."""
    if not isinstance(c, dict) or set(c) != {"type", "value"}:
        raise ValueError(f"structured must be a dict with keys 'type' and 'value', got {c!r}")
    t, v = c["type"], c["value"]
    if t not in TYPES:
        raise ValueError(f"structured type must be one of {list(TYPES)}, got {t!r}")
    if t == "json_object":
        if v is not None:
            raise ValueError("structured json_object takes no value")
        return
    if t == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
            raise ValueError("structured choice must be a non-empty list of non-empty strings")
        size = sum(len(s) for s in v)
    else:
        if not isinstance(v, str) or not v:
            raise ValueError(f"structured {t} must be a non-empty string")
        size = len(v)
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured {t} is too long ({size} characters)")


def check_after(after: Any) -> None:
    if after is None:
        return
    if (
        not isinstance(after, list)
        or not after
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in after)
    ):
        raise ValueError(f"structured_after must be a non-empty list of token ids, got {after!r}")


# Schema keywords whose values are subschemas (a dict), lists of them, or maps of them.
_SUB_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUB_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _bounded_strings(node: Any) -> Any:
    """The schema with every length-bounded plain string written as a pattern.

    xgrammar (0.2.x) builds a string with minLength/maxLength from the character class
    [^"\\\r\n], which lets raw control characters (tab, U+0000-U+001F) into the string:
    invalid JSON that strict parsers (Python's json, pydantic) reject. A pattern is matched on
    the decoded value and escaped by xgrammar itself, so `^[^\x00-\x1f]{m,n}$` keeps the
    same lengths with only characters that JSON allows unescaped."""
    if isinstance(node, list):
        return [_bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for k in _SUB_ONE:
        if isinstance(out.get(k), dict):
            out[k] = _bounded_strings(out[k])
    for k in _SUB_LIST:
        if isinstance(out.get(k), list):
            out[k] = _bounded_strings(out[k])
    for k in _SUB_MAP:
        if isinstance(out.get(k), dict):
            out[k] = {n: _bounded_strings(v) for n, v in out[k].items()}
    bounded = "minLength" in out or "maxLength" in out
    plain = not {"pattern", "format", "enum", "const"} & set(out)
    if out.get("type") == "string" and bounded and plain:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{'' if hi is None else hi}}}$"
        else:  # not integers: leave it to xgrammar to refuse
            out["minLength"], out["maxLength"] = lo, hi
    return out


def json_schema_text(v: str) -> str:
    """The schema text handed to xgrammar (see _bounded_strings); v as given if not JSON."""
    try:
        schema = json.loads(v)
    except ValueError:
        return v
    fixed = _bounded_strings(schema)
    return v if fixed == schema else json.dumps(fixed)


def choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are also xgrammar EBNF literal escapes; non-ASCII
    # stays literal (no surrogate pairs).
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


def _clean(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: drop those."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = msg.replace("Check failed: (error.empty()) is false: ", "")
    return msg.splitlines()[0] if msg else type(e).__name__


def _legacy_tag(value: dict[str, Any]):
    """vLLM's first structural-tag format ({"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}) as xgrammar's tag items and triggers."""
    import xgrammar as xgr

    items = []
    for s in value.get("structures") or []:
        if not isinstance(s, dict) or not {"begin", "end"} <= set(s):
            raise ConstraintError("structural_tag structures need 'begin', 'schema' and 'end'")
        schema = s.get("schema", {})
        items.append(
            xgr.StructuralTagItem(
                begin=s["begin"],
                schema=schema if isinstance(schema, str) else json.dumps(schema),
                end=s["end"],
            )
        )
    triggers = value.get("triggers")
    if not items or not isinstance(triggers, list) or not triggers:
        raise ConstraintError("structural_tag needs non-empty 'structures' and 'triggers'")
    return items, triggers


def _tag_value(v: str) -> Any:
    try:
        value = json.loads(v)
    except ValueError as e:
        raise ConstraintError(f"structural_tag is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConstraintError("structural_tag must be a JSON object")
    return value


def to_grammar(c: dict[str, Any]):
    """The xgrammar Grammar of a constraint (no tokenizer needed): validation. Raises
    ConstraintError naming the problem."""
    import xgrammar as xgr

    t, v = c["type"], c["value"]
    try:
        if t == "json":
            return xgr.Grammar.from_json_schema(
                json_schema_text(v),
                any_whitespace=ANY_WHITESPACE,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        if t == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}',
                any_whitespace=ANY_WHITESPACE,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        if t == "regex":
            return xgr.Grammar.from_regex(v)
        if t == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(v))
        if t == "grammar":
            return xgr.Grammar.from_ebnf(v)
        if t == "structural_tag":
            value = _tag_value(v)
            if "structures" in value:
                return xgr.Grammar.from_structural_tag(*_legacy_tag(value))
            return xgr.Grammar.from_structural_tag(v)
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
        raise ConstraintError(f"invalid {t} constraint: {_clean(e)}") from e
    raise ConstraintError(f"unknown constraint type {t!r}")


def compile_with(compiler, c: dict[str, Any]):
    """Compile a constraint with an xgrammar GrammarCompiler (its cache keys on the constraint
    text). Raises ConstraintError."""
    t, v = c["type"], c["value"]
    try:
        if t == "json":
            return compiler.compile_json_schema(
                json_schema_text(v),
                any_whitespace=ANY_WHITESPACE,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        if t == "json_object":
            return compiler.compile_json_schema(
                '{"type": "object"}',
                any_whitespace=ANY_WHITESPACE,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        if t == "regex":
            return compiler.compile_regex(v)
        if t == "choice":
            return compiler.compile_grammar(choice_ebnf(v))
        if t == "grammar":
            return compiler.compile_grammar(v)
        if t == "structural_tag":
            value = _tag_value(v)
            if "structures" in value:
                return compiler.compile_structural_tag(*_legacy_tag(value))
            return compiler.compile_structural_tag(v)
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - as in to_grammar
        raise ConstraintError(f"invalid {t} constraint: {_clean(e)}") from e
    raise ConstraintError(f"unknown constraint type {t!r}")
