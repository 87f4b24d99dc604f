"""An Anthropic Messages API request (POST /v1/messages) -> the internal chat request.

`system` (a string or text blocks) becomes the system message; each message's blocks become
chat messages: text blocks the content (concatenated, as the chat route joins text parts),
`tool_use` blocks the assistant's tool calls, `thinking` blocks its reasoning_content, and each
`tool_result` block a tool message (an `is_error` result's text starts with "Error: ", so the
model sees that the call failed). Tools are custom tools with an `input_schema`; tool_choice
auto / any / tool / none map to the chat route's auto / required / a named function / none.
`cache_control` marks are accepted and change nothing: the prefix cache is automatic here.
Every field and block key is checked; one this server does not implement is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from voltserve.services.gateway.chat_bridge import ChatCall
from voltserve.services.gateway.errors import bad_request
from voltserve.services.gateway.request_fields import media_note, refuse_unknown

MESSAGES_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "metadata",
        "service_tier",
    }
)
# The chat fields the translation fills, by the name an Anthropic client knows them by.
_NAMES = {
    "max_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "chat_template_kwargs": "thinking",
}
MAX_STOP_SEQUENCES = 16  # the chat route's bound on stop strings
ERROR_PREFIX = "Error: "
_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
_THINKING_MIN_BUDGET = 1024  # Anthropic's lower bound on budget_tokens


@dataclass
class MessagesRequest:
    call: ChatCall
    stream: bool
    thinking_omitted: bool  # thinking blocks are sent without their text (display "omitted")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text_block(block: dict[str, Any], where: str) -> str:
    refuse_unknown(block, _TEXT_KEYS, where)
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    if block.get("citations"):
        raise bad_request(f"{where}.citations are not supported", f"{where}.citations")
    return block["text"]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}[{j}] must be a content block with a type", f"{where}[{j}]")
    return content


def _unsupported(block: dict[str, Any], where: str, role: str, allowed: str) -> Exception:
    return bad_request(
        f"{where}.type {block['type']!r} is not supported in a {role} message "
        f"(this server takes {allowed}){media_note(block['type'])}",
        f"{where}.type",
    )


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    refuse_unknown(
        block, frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}), where
    )
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            if not isinstance(b, dict) or b.get("type") != "text":
                raise bad_request(f"{w}: only text blocks are supported in a tool result", w)
            texts.append(_text_block(b, w))
        content = "".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or text blocks", f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error must be a boolean", f"{where}.is_error")
    return ERROR_PREFIX + content if is_error else content


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for j, b in enumerate(_blocks(content, where)):
        w = f"{where}[{j}]"
        if b["type"] == "text":
            texts.append(_text_block(b, w))
        elif b["type"] == "tool_result":
            flush()
            text = _tool_result_text(b, w)
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise _unsupported(b, w, "user", "text and tool_result blocks")
    flush()
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for j, b in enumerate(_blocks(content, where)):
        w = f"{where}[{j}]"
        if b["type"] == "text":
            texts.append(_text_block(b, w))
        elif b["type"] == "tool_use":
            refuse_unknown(b, frozenset({"type", "id", "name", "input", "cache_control"}), w)
            for key in ("id", "name"):
                if not isinstance(b.get(key), str):
                    raise bad_request(f"{w}.{key} must be a string", f"{w}.{key}")
            if not isinstance(b.get("input"), dict):
                raise bad_request(f"{w}.input must be an object", f"{w}.input")
            args = json.dumps(b["input"], ensure_ascii=False)
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": args},
                }
            )
        elif b["type"] == "thinking":
            # The signature is what Anthropic's API checks; this server sends "" and has
            # nothing to check.
            refuse_unknown(b, frozenset({"type", "thinking", "signature", "cache_control"}), w)
            if not isinstance(b.get("thinking"), str):
                raise bad_request(f"{w}.thinking must be a string", f"{w}.thinking")
            thinking.append(b["thinking"])
        else:
            raise _unsupported(b, w, "assistant", "text, tool_use and thinking blocks")
    m: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        m["tool_calls"] = calls
    if thinking:
        m["reasoning_content"] = "".join(thinking)
    return m


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad_request("system must be a string or an array of text blocks", "system")
    texts = []
    for j, b in enumerate(system):
        w = f"system[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad_request(f"{w} must be a text block", w)
        texts.append(_text_block(b, w))
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.get("system") is not None:
        msgs.append({"role": "system", "content": _system(body["system"])})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise bad_request("messages must be a non-empty array", "messages")
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        refuse_unknown(m, frozenset({"role", "content"}), where)
        if m.get("role") == "user":
            msgs += _user(m.get("content"), f"{where}.content")
        elif m.get("role") == "assistant":
            if i == len(items) - 1:
                raise bad_request(
                    "the last message is an assistant turn (prefill), which this server does "
                    "not continue: end with a user message",
                    where,
                )
            msgs.append(_assistant(m.get("content"), f"{where}.content"))
        else:
            raise bad_request(
                f"{where}.role must be 'user' or 'assistant', got {m.get('role')!r}",
                f"{where}.role",
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
        if t.get("type") not in (None, "custom"):
            raise bad_request(
                f"{where}.type {t['type']!r} is not supported: this server runs custom tools "
                "(name, description, input_schema) only",
                f"{where}.type",
            )
        refuse_unknown(
            t,
            frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"}),
            where,
        )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(
                f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema"
            )
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        for key in ("description", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object with a type", "tool_choice")
    t = choice.get("type")
    keys = {"type"}
    if t in ("auto", "any", "tool"):
        keys.add("disable_parallel_tool_use")
    if t == "tool":
        keys.add("name")
    refuse_unknown(choice, frozenset(keys), "tool_choice")
    if t == "auto":
        chat["tool_choice"] = "auto"
    elif t == "any":
        chat["tool_choice"] = "required"
    elif t == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must be a string", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif t == "none":
        chat["tool_choice"] = "none"
    else:
        raise bad_request(
            f"tool_choice.type must be auto, any, tool or none, got {t!r}", "tool_choice.type"
        )
    single = choice.get("disable_parallel_tool_use")
    if single is not None:
        if not isinstance(single, bool):
            raise bad_request(
                "tool_choice.disable_parallel_tool_use must be a boolean",
                "tool_choice.disable_parallel_tool_use",
            )
        chat["parallel_tool_calls"] = not single


def _thinking(thinking: Any, max_tokens: Any, has_parser: bool) -> tuple[dict | None, bool]:
    """`thinking` -> (chat_template_kwargs, thinking text omitted). "disabled" turns the
    template's thinking off and "enabled" on (enable_thinking, as Qwen3's template reads it);
    "adaptive" leaves the template's default. budget_tokens is checked as Anthropic checks it
    but not enforced on its own: max_tokens bounds the whole output, reasoning included."""
    if thinking is None:
        return None, False
    if not isinstance(thinking, dict):
        raise bad_request("thinking must be an object", "thinking")
    t = thinking.get("type")
    keys = {"type"} | ({"budget_tokens", "display"} if t == "enabled" else set())
    keys |= {"display"} if t == "adaptive" else set()
    refuse_unknown(thinking, frozenset(keys), "thinking")
    if t not in ("enabled", "disabled", "adaptive"):
        raise bad_request(
            f"thinking.type must be enabled, disabled or adaptive, got {t!r}", "thinking.type"
        )
    if t == "disabled":
        return {"enable_thinking": False}, False
    if not has_parser:
        raise bad_request(
            "thinking needs the server to run with --reasoning-parser (without it, the "
            "reasoning would come mixed into the text)",
            "thinking",
        )
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad_request(
            f"thinking.display must be summarized or omitted, got {display!r}", "thinking.display"
        )
    if t == "adaptive":
        return None, display == "omitted"
    budget = thinking.get("budget_tokens")
    if not _is_int(budget) or budget < _THINKING_MIN_BUDGET:
        raise bad_request(
            f"thinking.budget_tokens must be an integer of at least {_THINKING_MIN_BUDGET}",
            "thinking.budget_tokens",
        )
    if _is_int(max_tokens) and budget >= max_tokens:
        raise bad_request(
            "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens"
        )
    return {"enable_thinking": True}, display == "omitted"


def _output_format(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    refuse_unknown(config, frozenset({"format", "effort"}), "output_config")
    if config.get("effort") is not None:
        raise bad_request(
            "output_config.effort is not supported: how much the model reasons is up to it",
            "output_config.effort",
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": ...}',
            "output_config.format",
        )
    refuse_unknown(fmt, frozenset({"type", "schema"}), "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def _check_labels(body: dict[str, Any]) -> None:
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object", "metadata")
        refuse_unknown(meta, frozenset({"user_id"}), "metadata")
        if meta.get("user_id") is not None and not isinstance(meta["user_id"], str):
            raise bad_request("metadata.user_id must be a string", "metadata.user_id")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad_request("service_tier must be auto or standard_only", "service_tier")


def parse_messages(body: dict[str, Any], has_reasoning_parser: bool) -> MessagesRequest:
    refuse_unknown(body, MESSAGES_FIELDS)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(
            f"max_tokens must be an integer of at least 1, got {max_tokens!r}", "max_tokens"
        )
    chat: dict[str, Any] = {"messages": _messages(body), "max_tokens": max_tokens}
    # Anthropic's ranges: temperature and top_p in [0, 1].
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise bad_request(f"{key} must be a number in [0, 1], got {v!r}", key)
            chat[key] = v
    if body.get("top_k") is not None:
        k = body["top_k"]
        if not _is_int(k) or k < 1:
            raise bad_request(f"top_k must be an integer of at least 1, got {k!r}", "top_k")
        chat["top_k"] = k
    stops = body.get("stop_sequences")
    if stops is not None:
        if (
            not isinstance(stops, list)
            or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_SEQUENCES
        ):
            raise bad_request(
                f"stop_sequences must be an array of at most {MAX_STOP_SEQUENCES} non-empty "
                "strings",
                "stop_sequences",
            )
        chat["stop"] = stops
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    kwargs, omitted = _thinking(body.get("thinking"), max_tokens, has_reasoning_parser)
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    _check_labels(body)
    return MessagesRequest(ChatCall(chat, dict(_NAMES)), bool(stream), omitted)
