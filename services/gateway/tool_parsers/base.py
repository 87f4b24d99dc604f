"""The interface every tool-call parser implements, and the streaming diff they share.

A parser only has to say how a model's text splits into plain content and tool calls, for a
text that may still be growing: `scan(text, final)`. Both outputs come from it:
- `parse(text)`: the whole text at once, `scan(text, final=True)`.
- `streamer()`: fed text deltas, it scans the text so far and sends what is new since the last
  scan, as OpenAI chat deltas (`content`, or `tool_calls[i]` with id/type/name first, then
  `function.arguments` in pieces).
A scan must be prefix-monotone (the content and every call's arguments of a prefix of the text
are prefixes of those of the longer text) and hold back text that may still turn into a marker;
then the streamed pieces put together are what parse() returns.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class PartialCall:
    name: str | None = None  # None until the whole name is known
    arguments: str = ""  # JSON text of the arguments so far (grows only)
    done: bool = False


@dataclass
class Scan:
    content: list[str] = field(default_factory=list)  # pieces of plain text, in order
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: text that must
    wait, since the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def visible_content(scan: Scan) -> str:
    """The content a client sees: each stretch of text outside the calls with its surrounding
    whitespace removed, the non-empty ones joined by newlines. Prefix-monotone as the pieces
    are (a growing last piece only ever adds text once its trailing whitespace is followed)."""
    return "\n".join(p.strip() for p in scan.content if p.strip())


class ToolParser:
    name = ""
    # The format's markers are special tokens, so the text must keep special tokens.
    needs_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls). A text whose calls do not parse is all content."""
        try:
            s = self.scan(text, final=True)
            calls = [_complete(c) for c in s.calls]
        except ValueError:
            return (text.strip() or None), []
        return (visible_content(s) or None), calls

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


def _complete(c: PartialCall) -> ToolCall:
    if c.name is None or not c.done:
        raise ValueError("incomplete tool call")
    try:
        args = json.loads(c.arguments) if c.arguments.strip() else {}
    except ValueError as e:
        raise ValueError(f"tool call arguments are not JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return ToolCall(c.name, c.arguments)


class ToolStreamer:
    """Turns text deltas into OpenAI chat deltas by rescanning the text so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []  # one per call whose name went out
        self.sent_args: list[int] = []
        self.failed = False

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, delta: str, final: bool = False) -> dict[str, Any]:
        """The delta fields (`content`, `tool_calls`) for the text added; {} when none."""
        self.text += delta
        if self.failed:
            return {"content": delta} if delta else {}
        try:
            s = self.parser.scan(self.text, final)
        except ValueError:
            # The text stopped looking like the parser's format: it is content from here on
            # (all of it, as parse() says, when no call went out yet).
            self.failed = True
            if self.ids:
                return {}
            content = self.text.strip()
            if (
                content.startswith(content[: self.sent_content])
                and len(content) > self.sent_content
            ):
                return {"content": content[self.sent_content :]}
            return {}
        out: dict[str, Any] = {}
        content = visible_content(s)
        if len(content) > self.sent_content and content.startswith(content[: self.sent_content]):
            out["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        calls = []
        for i, c in enumerate(s.calls):
            if c.name is None:
                break  # the name goes out first; nothing of a later call before it
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                calls.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": c.name, "arguments": ""},
                    }
                )
            new = c.arguments[self.sent_args[i] :]
            if new:
                self.sent_args[i] = len(c.arguments)
                if calls and calls[-1]["index"] == i:
                    calls[-1]["function"]["arguments"] += new
                else:
                    calls.append({"index": i, "function": {"arguments": new}})
        if calls:
            out["tool_calls"] = calls
        return out
