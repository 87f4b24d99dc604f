"""Reasoning parsers, chosen with `--reasoning-parser NAME` (vLLM's names): split a model's
`<think>...</think>` out of its text into `reasoning_content`.

As with the tool parsers, one prefix-monotone `scan(text, final)` gives both the whole-text
split and the streamed deltas, so the streamed pieces put together equal the whole-text split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from voltserve.services.gateway.tool_parsers.base import held_prefix

THINK, END_THINK = "<think>", "</think>"


@dataclass
class ReasoningScan:
    reasoning: str
    content: str
    ended: bool  # the reasoning is over (what follows is the answer)


class ReasoningParser:
    name = ""
    start, end = THINK, END_THINK
    # The output starts inside the reasoning (the template opened <think> in the prompt).
    starts_inside = False

    def scan(self, text: str, final: bool) -> ReasoningScan:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif not final and self.start.startswith(stripped):
            return ReasoningScan("", "", False)  # maybe the start tag: wait
        elif self.starts_inside:
            body = text
        else:
            return ReasoningScan("", text, True)  # no reasoning in this output
        k = body.find(self.end)
        if k < 0:
            held = 0 if final else held_prefix(body, self.end)
            return ReasoningScan(body[: len(body) - held], "", False)
        return ReasoningScan(body[:k], body[k + len(self.end) :], True)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole output."""
        s = self.scan(text, final=True)
        return (s.reasoning or None), (s.content.lstrip() or None)

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with <think>; with enable_thinking false the
    template closes an empty block in the prompt and the whole output is content."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and templates that open <think> in the prompt): the output starts inside
    the reasoning; an output with no </think> is all reasoning."""

    name = "deepseek_r1"
    starts_inside = True


class ReasoningStreamer:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning text, new content text) for the text added."""
        self.text += delta
        s = self.parser.scan(self.text, final)
        content = s.content.lstrip()
        r = s.reasoning[self.sent_reasoning :]
        c = content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(s.reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return r, c


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> Any:
    return REASONING_PARSERS[name]()
