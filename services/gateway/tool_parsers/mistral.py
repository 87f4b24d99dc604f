"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) and
`[TOOL_CALLS]name[ARGS]{...}` (v11 and later); text before the first marker is content."""

from __future__ import annotations

from voltserve.services.gateway.tool_parsers.base import PartialCall, Scan, ToolParser, held_prefix
from voltserve.services.gateway.tool_parsers.json_calls import json_call
from voltserve.services.gateway.tool_parsers.json_scan import skip_ws, value_end

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        s = Scan()
        i = 0
        while True:
            k = text.find(MARK, i)
            if k < 0:
                tail = text[i:]
                if not final:
                    tail = tail[: len(tail) - held_prefix(tail, MARK)]
                s.content.append(tail)
                return s
            s.content.append(text[i:k])
            j = skip_ws(text, k + len(MARK))
            if j >= len(text):
                if final:
                    raise ValueError("[TOOL_CALLS] with nothing after it")
                return s
            if text[j] in "[{":
                end = self._json_calls(text, j, s, final)
            else:
                end = self._named_call(text, j, s, final)
            if end is None:
                return s
            i = end

    @staticmethod
    def _json_calls(text: str, j: int, s: Scan, final: bool) -> int | None:
        """An array of call objects (or one object); the index past it, None while growing."""
        array = text[j] == "["
        if array:
            j = skip_ws(text, j + 1)
        while j < len(text):
            if array and text[j] == "]":
                return j + 1
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] != "{":
                raise ValueError("a [TOOL_CALLS] list that holds something other than objects")
            c, end = json_call(text, j)
            s.calls.append(c)
            if end is None:
                break
            if not array:
                return end
            j = skip_ws(text, end)
        if final:
            raise ValueError("an incomplete [TOOL_CALLS] list")
        return None

    @staticmethod
    def _named_call(text: str, j: int, s: Scan, final: bool) -> int | None:
        a = text.find(ARGS, j)
        if a < 0:
            if final:
                raise ValueError("[TOOL_CALLS] without [ARGS]")
            return None
        name = text[j:a].strip()
        if not name:
            raise ValueError("a tool call without a name")
        v = skip_ws(text, a + len(ARGS))
        c = PartialCall(name=name)
        s.calls.append(c)
        if v >= len(text):
            if final:
                raise ValueError("[ARGS] with nothing after it")
            return None
        if text[v] != "{":
            raise ValueError("[ARGS] not followed by a JSON object")
        end = value_end(text, v)
        c.arguments = text[v:end] if end is not None else text[v:]
        if end is None:
            if final:
                raise ValueError("incomplete [ARGS] JSON")
            return None
        c.done = True
        return end
