"""The structured-output fields of a request body -> one constraint (shared/structured.py).

Read from OpenAI's `response_format` (`text`, `json_object`, `json_schema`, and vLLM's
`structural_tag`), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`structural_tag`, `json_object`) and vLLM's older top-level `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one constraint per request: two at once, an unknown
key inside `structured_outputs` or an option we do not implement is a 400 naming it, never
silently dropped. Only the shape is checked here; the renderer builds the grammar with xgrammar,
so an invalid schema, regex or grammar is a 400 from there.
"""

from __future__ import annotations

import json
from typing import Any

from voltserve.services.gateway.body_limits import MAX_JSON_DEPTH, nests_deeper
from voltserve.services.gateway.errors import APIError, bad_request
from voltserve.shared.structured import check_shape

# structured_outputs key -> constraint type.
_SO_KEYS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
}
# vLLM options inside structured_outputs that change nothing here when false/absent (we never
# fall back to another backend); set to anything else they are refused.
_SO_OPTIONS_FALSY = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
_SO_OPTIONS_IGNORED = ("disable_fallback",)  # there is one backend: nothing to fall back from
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _schema_text(v: Any, param: str) -> str:
    """A JSON schema given as an object or as a JSON string -> its JSON text."""
    if isinstance(v, dict):
        return json.dumps(v)
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from e
        except RecursionError:
            raise _too_deep(param) from None
        if nests_deeper(parsed, MAX_JSON_DEPTH):
            raise _too_deep(param)
        if not isinstance(parsed, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema object", param)
        return v
    raise bad_request(f"{param} must be a JSON schema object", param)


def _too_deep(param: str) -> APIError:
    # A JSON document given as a string is held to the body's nesting bound: a schema's depth
    # decides how long its grammar takes to build.
    return bad_request(f"{param} is nested more than {MAX_JSON_DEPTH} levels deep", param)


def _check_tag_nesting(v: str, param: str) -> None:
    try:
        deep = nests_deeper(json.loads(v), MAX_JSON_DEPTH)
    except ValueError:
        return  # the renderer names what is wrong with it
    except RecursionError:
        deep = True
    if deep:
        raise _too_deep(param)


def _value(t: str, v: Any, param: str) -> dict[str, Any]:
    if t == "json":
        c = {"type": "json", "value": _schema_text(v, param)}
    elif t == "structural_tag":
        if isinstance(v, dict):
            v = json.dumps(v)
        elif isinstance(v, str):
            _check_tag_nesting(v, param)
        c = {"type": t, "value": v}
    else:
        c = {"type": t, "value": v}
    try:
        check_shape(c)
    except ValueError as e:
        raise bad_request(f"{param}: {e}".replace("structured ", ""), param) from e
    return c


def _from_response_format(body: dict) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    t = fmt.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return {"type": "json_object", "value": None}
    if t == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request(
                "response_format.json_schema must be an object", "response_format.json_schema"
            )
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise bad_request(
                f"response_format.json_schema has unknown fields {sorted(unknown)}",
                "response_format.json_schema",
            )
        if "schema" not in js or js["schema"] is None:
            raise bad_request(
                "response_format.json_schema.schema is required",
                "response_format.json_schema.schema",
            )
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                "response_format.json_schema.strict must be a boolean",
                "response_format.json_schema.strict",
            )
        # strict or not, the output follows the schema exactly (xgrammar's strict mode: no
        # properties beyond the schema's unless it allows them).
        return _value("json", js["schema"], "response_format.json_schema.schema")
    if t == "structural_tag":
        return _value("structural_tag", fmt, "response_format")
    raise bad_request(
        f"response_format type {t!r} is not supported "
        "(text, json_object, json_schema or structural_tag)",
        "response_format",
    )


def _from_structured_outputs(body: dict) -> list[tuple[str, dict[str, Any]]]:
    so = body.get("structured_outputs")
    if so is None:
        return []
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    found = []
    for key, v in so.items():
        param = f"structured_outputs.{key}"
        if key in _SO_KEYS:
            if v is None or (key == "json_object" and v is False):
                continue
            if key == "json_object":
                if v is not True:
                    raise bad_request(f"{param} must be a boolean", param)
                found.append((param, {"type": "json_object", "value": None}))
            else:
                found.append((param, _value(_SO_KEYS[key], v, param)))
        elif key in _SO_OPTIONS_FALSY:
            if v:
                raise bad_request(f"{param} is not supported", param)
        elif key in _SO_OPTIONS_IGNORED:
            if v is not None and not isinstance(v, bool):
                raise bad_request(f"{param} must be a boolean", param)
        else:
            raise bad_request(
                f"structured_outputs has an unknown field {key!r} (known: {sorted(_SO_KEYS)})",
                param,
            )
    return found


def parse_structured(body: dict) -> dict[str, Any] | None:
    """The request's constraint ({"type", "value"}) or None; APIError 400 naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = _from_response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    found += _from_structured_outputs(body)
    for key, t in _GUIDED.items():
        v = body.get(key)
        if v is not None:
            found.append((key, _value(t, v, key)))
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available (xgrammar only)",
            "guided_decoding_backend",
        )
    if len(found) > 1:
        names = [p for p, _ in found]
        raise bad_request(
            f"only one structured output constraint per request, got {', '.join(names)}",
            names[1],
        )
    return found[0][1] if found else None
