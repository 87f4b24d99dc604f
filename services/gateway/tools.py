"""Tool calling and reasoning on the chat endpoint: the request side (tools, tool_choice,
parallel_tool_calls checked; tools handed to the chat template; `required` and named functions
turned into a structured-output constraint) and the response side (a model's text split into
reasoning, content and tool calls, whole or as stream deltas).

Flags follow vLLM: `--enable-auto-tool-choice --tool-call-parser NAME` lets tool_choice "auto"
parse tool calls out of free text; `required` and a named function need no parser, since the
constraint makes the output a JSON value that is turned into the calls directly (as vLLM does).
`--reasoning-parser NAME` splits `<think>...</think>` into reasoning_content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from voltserve.services.gateway.errors import bad_request
from voltserve.services.gateway.params import GenerationSpec
from voltserve.services.gateway.reasoning_parsers import (
    END_THINK,
    REASONING_PARSERS,
    ReasoningParser,
)
from voltserve.services.gateway.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser
from voltserve.services.gateway.tool_parsers.base import new_call_id
from voltserve.services.gateway.tool_parsers.json_scan import skip_ws, value_end
from voltserve.shared.sampling_params import SamplingParams

# OpenAI's bound. The template writes every tool into the prompt (counted against the context)
# and tool_choice required builds a grammar over all of them.
MAX_TOOLS = 128
_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
# The structured-output engine's fields (SamplingParams.structured / structured_after).
HAS_STRUCTURED = "structured" in _PARAM_FIELDS
HAS_STRUCTURED_AFTER = "structured_after" in _PARAM_FIELDS


@dataclass
class ChatTooling:
    """The gateway's tool and reasoning flags, checked once at start-up."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    end_think_ids: list[int] = field(default_factory=list)  # the token ids of </think>

    @classmethod
    def from_flags(
        cls,
        enable_auto_tool_choice: bool,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        tokenizer: Any,
    ) -> ChatTooling:
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool_call_parser!r} is not one of {sorted(TOOL_PARSERS)}"
            )
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        ids: list[int] = []
        if reasoning_parser is not None:
            if reasoning_parser not in REASONING_PARSERS:
                raise ValueError(
                    f"--reasoning-parser {reasoning_parser!r} is not one of "
                    f"{sorted(REASONING_PARSERS)}"
                )
            ids = list(tokenizer.encode(END_THINK, add_special_tokens=False))
        return cls(enable_auto_tool_choice, tool_call_parser, reasoning_parser, ids)


@dataclass
class ChatPlan:
    """How one chat request's output is read back."""

    mode: str = "text"  # "text" | "auto" | "named" | "required"
    tools: list[dict[str, Any]] | None = None
    function: str | None = None  # mode "named"
    parallel: bool = True
    tool_parser: type[ToolParser] | None = None
    reasoning: ReasoningParser | None = None

    @property
    def plain(self) -> bool:
        return self.mode == "text" and self.reasoning is None

    def output(self) -> ChatOutput:
        return ChatOutput(self)


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty array", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(
            f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}", "tools"
        )
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be an object of type 'function'", "tools")
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"tools[{i}].function must be an object with a name", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", "tools")
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of {name, parameters}: one entry per call, each naming one of the tools and
    holding arguments that match that tool's schema (vLLM's form for tool_choice=required)."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_chat(body: dict[str, Any], spec: GenerationSpec, tooling: ChatTooling) -> ChatPlan:
    """Check the tool fields of a chat request and set up spec for them (400s name the field)."""
    plan = ChatPlan()
    if tooling.reasoning_parser is not None:
        plan.reasoning = REASONING_PARSERS[tooling.reasoning_parser]()
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    plan.parallel = parallel is not False
    if tools is not None:
        plan.tools = _check_tools(tools)
        # Rendered by the model's own template, as transformers' apply_chat_template does.
        spec.chat_template_kwargs = {"tools": plan.tools, **(spec.chat_template_kwargs or {})}
    if choice is None:
        choice = "auto" if plan.tools else "none"
    if choice != "none" and plan.tools is None:
        raise bad_request("tool_choice needs tools to be set", "tool_choice")
    if choice == "none":
        pass
    elif choice == "auto":
        if not (tooling.enable_auto_tool_choice and tooling.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )
        plan.mode = "auto"
        plan.tool_parser = TOOL_PARSERS[tooling.tool_call_parser]
        if plan.tool_parser.needs_special_tokens:
            # The format's markers are special tokens: the parser must see them.
            spec.skip_special_tokens = False
    elif choice == "required":
        plan.mode = "required"
        _constrain(spec, required_schema(plan.tools, plan.parallel), "required")
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        tool = next((t for t in plan.tools if t["function"]["name"] == name), None)
        if tool is None:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        plan.mode, plan.function = "named", name
        _constrain(spec, _parameters(tool), "a named function")
    else:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if (
        plan.reasoning is not None
        and getattr(spec.params, "structured", None) is not None
        and HAS_STRUCTURED_AFTER
        and _will_reason(plan.reasoning, spec)
    ):
        # The constraint starts once the reasoning is over.
        spec.params.structured_after = list(tooling.end_think_ids)
    return plan


def _will_reason(parser: ReasoningParser, spec: GenerationSpec) -> bool:
    """Whether the output surely holds a </think> before the answer. The engine keeps the
    constraint off until that marker, so a guess of True for an output that never reasons
    would leave it unconstrained; a guess of False only constrains the reasoning too.
    deepseek_r1: the output starts inside the reasoning unless thinking was turned off.
    qwen3: reasoning is optional (the model may answer without <think>): only when the
    request turns thinking on explicitly."""
    thinking = (spec.chat_template_kwargs or {}).get("enable_thinking")
    if parser.starts_inside:
        return thinking is not False
    return thinking is True


def _constrain(spec: GenerationSpec, schema: dict[str, Any], what: str) -> None:
    if not HAS_STRUCTURED:
        raise bad_request(
            f"tool_choice {what} needs structured outputs, which this build does not have",
            "tool_choice",
        )
    if getattr(spec.params, "structured", None) is not None:
        raise bad_request(
            f"tool_choice {what} cannot be combined with another output constraint "
            "(response_format, structured_outputs, guided_*)",
            "tool_choice",
        )
    spec.params.structured = {"type": "json", "value": json.dumps(schema)}


# ---- the response side ---------------------------------------------------------------------


def _calls_from_required(text: str) -> list[ToolCall]:
    items = json.loads(text)
    if not isinstance(items, list):
        raise ValueError("not a list")
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            raise ValueError("not a {name, parameters} object")
        args = it.get("parameters", {})
        calls.append(ToolCall(it["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class ChatOutput:
    """One choice's text, read the way its plan says: `message(text)` for a whole output,
    `feed(delta, final)` for stream deltas (fields of an OpenAI chat delta)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = plan.reasoning.streamer() if plan.reasoning is not None else None
        self.tools = None
        if plan.mode == "auto":
            assert plan.tool_parser is not None
            self.tools = plan.tool_parser(plan.tools).streamer()
        self.text = ""  # content so far (named / required)
        self.sent = 0  # named: argument characters sent; required: calls sent
        self.call_id: str | None = None
        self.num_tool_calls = 0

    def finish_reason(self, finish: str | None) -> str | None:
        if finish == "stop" and self.num_tool_calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return finish

    # ---- whole output ----

    def message(self, text: str) -> dict[str, Any]:
        plan = self.plan
        reasoning, content = None, text
        if plan.reasoning is not None:
            reasoning, content = plan.reasoning.split(text)
        calls: list[ToolCall] = []
        if plan.mode == "auto":
            assert plan.tool_parser is not None
            content, calls = plan.tool_parser(plan.tools).parse(content or "")
            if not plan.parallel:
                calls = calls[:1]
        elif plan.mode == "named":
            calls = [ToolCall(plan.function or "", (content or "").strip())]
            content = None
        elif plan.mode == "required":
            try:
                calls = _calls_from_required(content or "")
                content = None
            except ValueError:
                calls = []  # not the constrained form (cut off by max_tokens): keep the text
        self.num_tool_calls = len(calls)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if plan.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if plan.tools is not None:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    # ---- stream ----

    def feed(self, delta: str, final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content = delta
        if self.reasoning is not None:
            r, content = self.reasoning.feed(delta, final)
            if r:
                out["reasoning_content"] = r
        mode = self.plan.mode
        if mode == "text":
            if content:
                out["content"] = content
        elif mode == "auto":
            assert self.tools is not None
            d = self.tools.feed(content, final)
            if not self.plan.parallel and "tool_calls" in d:
                d["tool_calls"] = [c for c in d["tool_calls"] if c["index"] == 0]
                if not d["tool_calls"]:
                    del d["tool_calls"]
            out.update(d)
            self.num_tool_calls = min(
                self.tools.num_calls, 1 if not self.plan.parallel else 1 << 30
            )
        elif mode == "named":
            self.text += content
            args = self.text.strip()
            calls = []
            if self.call_id is None and (args or final):
                self.call_id = new_call_id()
                self.num_tool_calls = 1
                calls.append(
                    {
                        "index": 0,
                        "id": self.call_id,
                        "type": "function",
                        "function": {"name": self.plan.function, "arguments": ""},
                    }
                )
            if len(args) > self.sent:
                piece = args[self.sent :]
                self.sent = len(args)
                if calls:
                    calls[0]["function"]["arguments"] = piece
                else:
                    calls.append({"index": 0, "function": {"arguments": piece}})
            if calls:
                out["tool_calls"] = calls
        else:  # required: each call goes out once its {name, parameters} object is complete
            self.text += content
            calls = []
            for i, c in enumerate(_complete_items(self.text)):
                if i < self.sent:
                    continue
                self.sent += 1
                self.num_tool_calls += 1
                call = ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                calls.append({"index": i, **call.to_openai()})
            if calls:
                out["tool_calls"] = calls
        return out


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The complete {name, parameters} objects at the start of a (growing) JSON list."""
    out: list[dict[str, Any]] = []
    j = skip_ws(text, 0)
    if j >= len(text) or text[j] != "[":
        return out
    j = skip_ws(text, j + 1)
    while j < len(text) and text[j] == "{":
        end = value_end(text, j)
        if end is None:
            break
        try:
            item = json.loads(text[j:end])
        except ValueError:
            break
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            break
        out.append(item)
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    return out
