"""The Messages API's output: the message object with its content blocks (thinking, text,
tool_use), whole or as Anthropic's stream of events:

message_start (the message with no content yet); per block content_block_start, its deltas
(content_block_delta with text_delta, thinking_delta or input_json_delta) and
content_block_stop; message_delta with the stop_reason, stop_sequence and usage; message_stop.
Each event is `event: NAME` then `data: JSON`. An error after the stream began is an `error`
event in Anthropic's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from voltserve.services.gateway import sse
from voltserve.services.gateway.anthropic_errors import error_body
from voltserve.services.gateway.chat_bridge import (
    REASONING,
    TEXT,
    Appended,
    Block,
    Closed,
    Ending,
    Opened,
    StreamEvent,
    Usage,
)
from voltserve.services.gateway.errors import APIError


def stop_reason(ending: Ending) -> str:
    if ending.finish_reason == "length":
        return "max_tokens"
    if ending.num_tool_calls:
        return "tool_use"
    if ending.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_of(usage: Usage) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


class MessageBuilder:
    def __init__(self, message_id: str, model: str, thinking_omitted: bool) -> None:
        self.id = message_id
        self.model = model
        self.omitted = thinking_omitted

    def block(self, b: Block, whole: bool = True) -> dict[str, Any]:
        """A content block; not `whole`: as content_block_start announces it."""
        if b.kind == REASONING:
            text = b.text if whole and not self.omitted else ""
            return {"type": "thinking", "thinking": text, "signature": ""}
        if b.kind == TEXT:
            return {"type": "text", "text": b.text if whole else ""}
        args: Any = {}
        if whole:
            try:
                args = json.loads(b.text) if b.text.strip() else {}
            except ValueError:
                args = None
            if not isinstance(args, dict):
                # Arguments cut off by max_tokens: kept as the text they are, never invented.
                return {"type": "text", "text": b.text}
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": args}

    def message(
        self, content: list[dict[str, Any]], ending: Ending | None, usage: Usage
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(ending) if ending is not None else None,
            "stop_sequence": ending.stop_sequence if ending is not None else None,
            "usage": usage_of(usage),
        }

    def whole(self, blocks: list[Block], ending: Ending) -> dict[str, Any]:
        return self.message([self.block(b) for b in blocks], ending, ending.usage)


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + sse.event(obj)


class MessagesStream:
    """The Anthropic events of one streamed request (chat_bridge.StreamWriter)."""

    def __init__(self, builder: MessageBuilder) -> None:
        self.b = builder

    def start(self, usage: Usage) -> bytes:
        # Nothing generated is counted yet: message_delta carries the output tokens.
        at_start = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
        message = self.b.message([], None, at_start)
        return _event("message_start", {"type": "message_start", "message": message})

    def event(self, ev: StreamEvent) -> bytes:
        if isinstance(ev, Opened):
            return _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": ev.index,
                    "content_block": self.b.block(ev.block, whole=False),
                },
            )
        if isinstance(ev, Appended):
            kind = ev.block.kind
            if kind == REASONING:
                if self.b.omitted:
                    return b""
                delta = {"type": "thinking_delta", "thinking": ev.text}
            elif kind == TEXT:
                delta = {"type": "text_delta", "text": ev.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": ev.text}
            return _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": ev.index, "delta": delta},
            )
        assert isinstance(ev, Closed)
        return _event("content_block_stop", {"type": "content_block_stop", "index": ev.index})

    def end(self, blocks: list[Block], ending: Ending) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(ending), "stop_sequence": ending.stop_sequence},
            "usage": usage_of(ending.usage),
        }
        return _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})

    def error(self, e: APIError) -> bytes:
        return _event("error", error_body(e.status, e.message, e.param))
