"""hermes: Qwen2.5 / Qwen3 / Hermes models, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, text around the blocks is content."""

from __future__ import annotations

from voltserve.services.gateway.tool_parsers.base import Scan, ToolParser, held_prefix
from voltserve.services.gateway.tool_parsers.json_calls import json_call
from voltserve.services.gateway.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        s = Scan()
        i = 0
        while True:
            k = text.find(START, i)
            if k < 0:
                tail = text[i:]
                if not final:
                    tail = tail[: len(tail) - held_prefix(tail, START)]
                s.content.append(tail)
                return s
            s.content.append(text[i:k])
            j = skip_ws(text, k + len(START))
            e = text.find(END, j)
            body = text[: e if e >= 0 else len(text)]
            if j >= len(body):
                if e < 0 and not final:
                    return s  # the call's JSON has not started yet
                raise ValueError("an empty <tool_call> block")
            if body[j] != "{":
                raise ValueError("a <tool_call> block that does not hold a JSON object")
            c, end = json_call(body, j)
            if end is None and (e >= 0 or final):
                raise ValueError("a <tool_call> block whose JSON is incomplete")
            s.calls.append(c)
            if e < 0:
                # No end tag yet (or the model stopped right after the object): nothing more.
                return s
            i = e + len(END)
