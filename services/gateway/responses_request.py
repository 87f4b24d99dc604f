"""A Responses API request (POST /v1/responses) -> the internal chat request.

Stateless: the whole conversation comes in `input` (a string, or items: messages with text
parts, `function_call`, `function_call_output` and `reasoning` items as an earlier response
returned them); `previous_response_id`, `conversation`, `store: true` and `background: true`
need responses kept on the server, which this server does not do, and are refused. Function
tools only. Every field and item key is checked; one this server does not implement is a 400
naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from voltserve.services.gateway.chat_bridge import ChatCall
from voltserve.services.gateway.errors import bad_request
from voltserve.services.gateway.request_fields import media_note, refuse_unknown

RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "include",
        "truncation",
        "service_tier",
        # Opaque labels and hints with no effect on the output (prompt_cache_key: the prefix
        # cache is automatic here).
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        # Accepted only with the values that keep nothing on the server.
        "store",
        "background",
        "previous_response_id",
        "conversation",
        # vLLM's sampling extensions, as on the chat route.
        "top_k",
        "min_p",
        "repetition_penalty",
        "seed",
    }
)
# Passed to the chat request as they are.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
# The chat fields the translation fills, by the Responses name a client knows them by.
_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}
# include values: reasoning items carry their text in `content` (nothing is encrypted), which a
# stateless client sends back as it is.
_INCLUDE = frozenset({"reasoning.encrypted_content"})
_STATELESS = "this server keeps no responses: send the whole conversation in `input`"
_TEXT_PARTS = ("input_text", "output_text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass
class ResponsesRequest:
    call: ChatCall
    stream: bool
    # Echoed in the response object.
    echo: dict[str, Any] = field(default_factory=dict)


def _is(v: Any, t: type | tuple[type, ...]) -> bool:
    return isinstance(v, t) and not isinstance(v, bool)


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{w} must be an object", w)
        t = part.get("type")
        if t not in _TEXT_PARTS:
            raise bad_request(
                f"{w}.type {t!r} is not supported: this server takes text parts "
                f"({', '.join(_TEXT_PARTS)}){media_note(t)}",
                f"{w}.type",
            )
        refuse_unknown(part, frozenset({"type", "text", "annotations", "logprobs"}), w)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{w}.text must be a string", f"{w}.text")
        if part.get("annotations"):
            raise bad_request(f"{w}.annotations are not supported", f"{w}.annotations")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    refuse_unknown(
        item, frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}), where
    )
    if item.get("encrypted_content") is not None:
        raise bad_request(
            f"{where}.encrypted_content is not supported: this server does not encrypt "
            "reasoning (send the item's `content` back as it was returned)",
            f"{where}.encrypted_content",
        )
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad_request(f"{where}.content must be an array", f"{where}.content")
    texts = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or not isinstance(p.get("text"), str):
            raise bad_request(f"{where} part {j} must be an object with a text", where)
        texts.append(p["text"])
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        msgs.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    reasoning: str | None = None  # a reasoning item waits for the assistant turn it belongs to
    # The assistant message that a function_call joins: the one this turn began (an earlier
    # response's output is a message item and then its calls).
    turn: dict[str, Any] | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning, turn
        m: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning is not None:
            m["reasoning_content"], reasoning = reasoning, None
        msgs.append(m)
        turn = m
        return m

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        t = item.get("type", "message" if "role" in item else None)
        if t == "reasoning":
            if reasoning is not None:
                raise bad_request(f"{where}: two reasoning items in a row", where)
            reasoning = _reasoning_text(item, where)
            continue
        if reasoning is not None and not (
            t == "function_call" or (t == "message" and item.get("role") == "assistant")
        ):
            raise bad_request(
                f"input[{i - 1}]: a reasoning item must be followed by the assistant message "
                "or function call it belongs to",
                f"input[{i - 1}]",
            )
        if t == "message":
            refuse_unknown(item, frozenset({"type", "role", "content", "id", "status"}), where)
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(
                    f"{where}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}",
                    f"{where}.role",
                )
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant()["content"] = text
            else:
                msgs.append({"role": role, "content": text})
                turn = None
        elif t == "function_call":
            refuse_unknown(
                item, frozenset({"type", "id", "call_id", "name", "arguments", "status"}), where
            )
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
            m = turn if turn is not None and reasoning is None else assistant()
            m.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif t == "function_call_output":
            refuse_unknown(item, frozenset({"type", "id", "call_id", "output", "status"}), where)
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            turn = None
        else:
            raise bad_request(
                f"{where}.type {t!r} is not supported: this server takes message, "
                "function_call, function_call_output and reasoning items",
                f"{where}.type",
            )
    if reasoning is not None:
        raise bad_request(
            "input ends with a reasoning item: it must be followed by the assistant message "
            "or function call it belongs to",
            "input",
        )
    return msgs


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", where)
        if t.get("type") != "function":
            raise bad_request(
                f"{where}.type {t.get('type')!r} is not supported: this server runs function "
                "tools only",
                f"{where}.type",
            )
        refuse_unknown(t, frozenset({"type", "name", "description", "parameters", "strict"}), where)
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise bad_request(f"{where}.parameters must be a JSON schema", f"{where}.parameters")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # none | auto | required; anything else: the chat check names it
    if isinstance(choice, dict) and choice.get("type") == "function":
        refuse_unknown(choice, frozenset({"type", "name"}), "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text` -> the chat request's response_format (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    refuse_unknown(text, frozenset({"format", "verbosity"}), "text")
    if text.get("verbosity") is not None:
        raise bad_request(
            "text.verbosity is not supported: how long the answer is is up to the model",
            "text.verbosity",
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    t = fmt.get("type")
    if t == "text":
        refuse_unknown(fmt, frozenset({"type"}), "text.format")
        return None
    if t == "json_object":
        refuse_unknown(fmt, frozenset({"type"}), "text.format")
        return {"type": "json_object"}
    if t == "json_schema":
        refuse_unknown(
            fmt, frozenset({"type", "name", "schema", "strict", "description"}), "text.format"
        )
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "text.format.schema must be a JSON schema object", "text.format.schema"
            )
        for key in ("name", "description"):
            if fmt.get(key) is not None and not isinstance(fmt[key], str):
                raise bad_request(f"text.format.{key} must be a string", f"text.format.{key}")
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    raise bad_request(
        f"text.format.type {t!r} is not supported (text, json_object or json_schema)",
        "text.format.type",
    )


def _reasoning(reasoning: Any, has_parser: bool) -> dict[str, Any] | None:
    """`reasoning` -> chat_template_kwargs. effort "none" turns the template's thinking off,
    any other effort turns it on (enable_thinking, as Qwen3's template reads it); the level
    itself is not graded. Summaries are not generated: the reasoning comes whole, as
    reasoning_text, where the server has a reasoning parser."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning must be an object", "reasoning")
    refuse_unknown(reasoning, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            raise bad_request(
                f"reasoning.{key} {reasoning[key]!r} is not supported: this server returns "
                "the reasoning itself, never a summary",
                f"reasoning.{key}",
            )
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad_request(f"reasoning.effort {effort!r} is not a known effort", "reasoning.effort")
    if effort != "none" and not has_parser:
        raise bad_request(
            "reasoning.effort needs the server to run with --reasoning-parser (without it, "
            "reasoning would come mixed into the output text)",
            "reasoning.effort",
        )
    return {"enable_thinking": effort != "none"}


def _check_options(body: dict[str, Any]) -> None:
    """The fields that change nothing here, accepted only with the values that say so."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise bad_request(f"{key} is not supported: {_STATELESS}", key)
    for key in ("store", "background"):
        if body.get(key) not in (None, False):
            raise bad_request(f"{key} must be false: {_STATELESS}", key)
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise bad_request("include must be an array", "include")
        for v in include:
            if v not in _INCLUDE:
                raise bad_request(f"include value {v!r} is not supported", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(
            'truncation must be "disabled": a conversation longer than the context is a 400',
            "truncation",
        )
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad_request("service_tier must be auto or default (one tier here)", "service_tier")
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad_request(f"{key} must be a string", key)


def parse_responses(body: dict[str, Any], has_reasoning_parser: bool) -> ResponsesRequest:
    refuse_unknown(body, RESPONSES_FIELDS)
    _check_options(body)
    chat: dict[str, Any] = {"messages": _messages(body)}
    for key in _SAMPLING:
        if key in body:
            chat[key] = body[key]
    mot = body.get("max_output_tokens")
    if mot is not None:
        if not _is(mot, int) or mot < 1:
            raise bad_request(
                f"max_output_tokens must be an integer of at least 1, got {mot!r}",
                "max_output_tokens",
            )
        chat["max_tokens"] = mot
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    kwargs = _reasoning(body.get("reasoning"), has_reasoning_parser)
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    if body.get("metadata") is not None:
        chat["metadata"] = body["metadata"]  # the chat check: an object of strings
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": mot,
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "reasoning": {
            "effort": (body.get("reasoning") or {}).get("effort"),
            "summary": (body.get("reasoning") or {}).get("summary"),
        },
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "user": body.get("user"),
    }
    return ResponsesRequest(ChatCall(chat, dict(_NAMES)), bool(stream), echo)
