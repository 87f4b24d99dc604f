"""llama3_json: Llama 3.1+ JSON tool calls, `{"name": ..., "parameters": {...}}` at the start of
the output (optionally after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from voltserve.services.gateway.tool_parsers.base import Scan, ToolParser
from voltserve.services.gateway.tool_parsers.json_calls import json_call
from voltserve.services.gateway.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        rest = text[j:]
        if rest.startswith(TAG):
            j = skip_ws(text, j + len(TAG))
        elif not final and rest and TAG.startswith(rest):
            return Scan()  # maybe the tag, maybe not: wait
        if j >= len(text):
            return Scan(content=[text] if final else [])
        if text[j] != "{":
            return Scan(content=[text])  # not a tool call: all of it is content
        s = Scan()
        while j < len(text):
            c, end = json_call(text, j)
            s.calls.append(c)
            if end is None:
                if final:
                    raise ValueError("an incomplete JSON tool call")
                return s
            j = skip_ws(text, end)
            if j < len(text):
                if text[j] != ";":
                    raise ValueError("text after a JSON tool call")
                j = skip_ws(text, j + 1)
        return s
