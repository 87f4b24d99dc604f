"""The Responses API's output: the response object with its output items (a reasoning item, a
message with one output_text part, a function_call per tool call), whole or as the stream of
Responses events, in OpenAI's order:

response.created, response.in_progress; per item response.output_item.added, then for a message
or reasoning item response.content_part.added, its text deltas (response.output_text.delta /
response.reasoning_text.delta), the text's done event and response.content_part.done, for a
function call response.function_call_arguments.delta / .done; response.output_item.done; last
response.completed (response.incomplete when the output hit max_output_tokens). Every event
carries a sequence_number; an error after the stream began is an `error` event followed by
response.failed.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from voltserve.services.gateway import sse
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

_ID_PREFIX = {REASONING: "rs", TEXT: "msg"}


class ResponseBuilder:
    """The response object of one request, and the ids of its items."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], tokenizer: Any):
        self.id = response_id
        self.model = model
        self.echo = echo
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.item_ids: list[str] = []

    def item_id(self, index: int, block: Block) -> str:
        while len(self.item_ids) <= index:
            self.item_ids.append("")
        if not self.item_ids[index]:
            prefix = _ID_PREFIX.get(block.kind, "fc")
            self.item_ids[index] = f"{prefix}_{uuid.uuid4().hex}"
        return self.item_ids[index]

    def item(self, index: int, block: Block, status: str, whole: bool = True) -> dict[str, Any]:
        """The output item of a block; not `whole`: as it is announced, with no text yet."""
        iid = self.item_id(index, block)
        if block.kind == REASONING:
            content = [reasoning_part(block.text)] if whole else []
            return {
                "id": iid,
                "type": "reasoning",
                "summary": [],
                "content": content,
                "status": status,
            }
        if block.kind == TEXT:
            return {
                "id": iid,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [text_part(block.text)] if whole else [],
            }
        return {
            "id": iid,
            "type": "function_call",
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text if whole else "",
            "status": status,
        }

    def output(self, blocks: list[Block], ending: Ending) -> list[dict[str, Any]]:
        cut = ending.finish_reason == "length"
        return [
            self.item(i, b, "incomplete" if cut and i == len(blocks) - 1 else "completed")
            for i, b in enumerate(blocks)
        ]

    def usage(self, blocks: list[Block], usage: Usage) -> dict[str, Any]:
        # The engine counts tokens, not which of them were reasoning: the reasoning's share is
        # its text tokenized again (within a token or two of what the model generated).
        reasoning = sum(
            len(self.tokenizer.encode(b.text, add_special_tokens=False))
            for b in blocks
            if b.kind == REASONING
        )
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        ending: Ending | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete" and ending is not None:
            reason = "max_output_tokens" if ending.finish_reason == "length" else None
            incomplete = {"reason": reason}
        e = self.echo
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": e["instructions"],
            "max_output_tokens": e["max_output_tokens"],
            "metadata": e["metadata"],
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e["parallel_tool_calls"],
            "previous_response_id": None,
            "reasoning": e["reasoning"],
            "store": False,
            "temperature": e["temperature"],
            "text": e["text"],
            "tool_choice": e["tool_choice"],
            "tools": e["tools"],
            "top_p": e["top_p"],
            "truncation": "disabled",
            "usage": usage,
            "user": e["user"],
        }

    def whole(self, blocks: list[Block], ending: Ending) -> dict[str, Any]:
        return self.response(
            status_of(ending),
            self.output(blocks, ending),
            self.usage(blocks, ending.usage),
            ending,
        )


def status_of(ending: Ending) -> str:
    return "completed" if ending.finish_reason == "stop" else "incomplete"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


class ResponsesStream:
    """The Responses events of one streamed request (chat_bridge.StreamWriter)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0

    def _event(self, type_: str, **fields: Any) -> bytes:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\n".encode() + sse.event(obj)

    def start(self, usage: Usage) -> bytes:
        r = self.b.response("in_progress", [], None)
        return self._event("response.created", response=r) + self._event(
            "response.in_progress", response=r
        )

    def event(self, ev: StreamEvent) -> bytes:
        b, k = ev.block, ev.index
        iid = self.b.item_id(k, b)
        if isinstance(ev, Opened):
            out = self._event(
                "response.output_item.added",
                output_index=k,
                item=self.b.item(k, b, "in_progress", whole=False),
            )
            if b.kind in (REASONING, TEXT):
                part = reasoning_part("") if b.kind == REASONING else text_part("")
                out += self._event(
                    "response.content_part.added",
                    item_id=iid,
                    output_index=k,
                    content_index=0,
                    part=part,
                )
            return out
        if isinstance(ev, Appended):
            if b.kind == REASONING:
                return self._event(
                    "response.reasoning_text.delta",
                    item_id=iid,
                    output_index=k,
                    content_index=0,
                    delta=ev.text,
                )
            if b.kind == TEXT:
                return self._event(
                    "response.output_text.delta",
                    item_id=iid,
                    output_index=k,
                    content_index=0,
                    delta=ev.text,
                    logprobs=[],
                )
            return self._event(
                "response.function_call_arguments.delta", item_id=iid, output_index=k, delta=ev.text
            )
        assert isinstance(ev, Closed)
        out = b""
        if b.kind == REASONING:
            out += self._event(
                "response.reasoning_text.done",
                item_id=iid,
                output_index=k,
                content_index=0,
                text=b.text,
            )
        elif b.kind == TEXT:
            out += self._event(
                "response.output_text.done",
                item_id=iid,
                output_index=k,
                content_index=0,
                text=b.text,
                logprobs=[],
            )
        else:
            out += self._event(
                "response.function_call_arguments.done",
                item_id=iid,
                output_index=k,
                name=b.name,
                arguments=b.text,
            )
        if b.kind in (REASONING, TEXT):
            part = reasoning_part(b.text) if b.kind == REASONING else text_part(b.text)
            out += self._event(
                "response.content_part.done",
                item_id=iid,
                output_index=k,
                content_index=0,
                part=part,
            )
        item = self.b.item(k, b, "incomplete" if ev.cut else "completed")
        return out + self._event("response.output_item.done", output_index=k, item=item)

    def end(self, blocks: list[Block], ending: Ending) -> bytes:
        status = status_of(ending)
        r = self.b.whole(blocks, ending)
        return self._event(f"response.{status}", response=r)

    def error(self, e: APIError) -> bytes:
        err = {"code": str(e.code), "message": e.message}
        out = self._event("error", code=str(e.code), message=e.message, param=e.param)
        return out + self._event(
            "response.failed", response=self.b.response("failed", [], None, error=err)
        )
