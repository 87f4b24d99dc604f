"""Chat templates from the tokenizer's config, rendered in a sandboxed Jinja environment with the
helpers Hugging Face templates expect (raise_exception, tojson, strftime_now, loop controls)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # Templates call tojson with Python's keywords (indent, separators, sort_keys).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def pick_template(source: str | dict | list | None, name: str | None = None) -> str | None:
    """A tokenizer's chat_template may be one string or several named ones."""
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        source = {t["name"]: t["template"] for t in source}
    return source.get(name or "default") or next(iter(source.values()), None)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content parts -> plain strings (text parts only). ValueError on anything else."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        elif content is None:
            # An assistant turn may carry only tool calls; templates expect a string.
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}] ({m['role']}) has no content")
            m["content"] = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        if m["role"] == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = _template_tool_calls(i, m["tool_calls"])
        out.append(m)
    return out


def _template_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant turn's tool calls with their arguments as objects: OpenAI clients send the
    arguments as a JSON string, templates (Qwen, Llama, Mistral) write them with tojson, so a
    string would come out quoted twice (vLLM parses them the same way)."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be an array")
    out = []
    for j, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object with a function")
        f = dict(c["function"])
        if isinstance(f.get("arguments"), str):
            try:
                f["arguments"] = json.loads(f["arguments"])
            except ValueError as e:
                raise ValueError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"
                ) from e
        out.append({**c, "function": f})
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        self.special_tokens = special_tokens
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        variables = {**self.special_tokens, "tools": tools, **kwargs}
        try:
            return self.template.render(
                messages=normalize_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError:
            raise
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template bug is the caller's 400, not a crash
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def from_tokenizer(tokenizer: Any, name: str | None = None) -> ChatTemplate | None:
    source = pick_template(getattr(tokenizer, "chat_template", None), name)
    if not source:
        return None
    special = {
        k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    return ChatTemplate(
        source, {k: (v if isinstance(v, str) else None) for k, v in special.items()}
    )
