"""qwen3_coder: Qwen3-Coder's XML-style calls,
`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`.
Values are text; each is converted to the JSON type its parameter has in the tool's schema
(a string stays a string, numbers, booleans, objects and arrays are parsed)."""

from __future__ import annotations

import json
from typing import Any

from voltserve.services.gateway.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    held_prefix,
)

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

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
            e = text.find(END, k)
            body = text[k + len(START) : e if e >= 0 else len(text)]
            c = self._call(body, closed=e >= 0 or final)
            if c is not None:
                s.calls.append(c)
            if e < 0:
                if final and (c is None or not c.done):
                    raise ValueError("an unterminated <tool_call> block")
                return s
            if c is None or not c.done:
                raise ValueError("a <tool_call> block without a complete <function=...>")
            i = e + len(END)

    def _call(self, body: str, closed: bool) -> PartialCall | None:
        f = body.find(FUNC)
        if f < 0:
            if body.strip() and not FUNC.startswith(body.strip()):
                raise ValueError("a <tool_call> block without <function=...>")
            return None
        g = body.find(">", f)
        if g < 0:
            return None
        c = PartialCall(name=body[f + len(FUNC) : g].strip())
        parts: list[str] = []
        j = g + 1
        while True:
            p = body.find(PARAM, j)
            fe = body.find(FUNC_END, j)
            if p < 0 or (0 <= fe < p):
                break
            q = body.find(">", p)
            if q < 0:
                break
            pname = body[p + len(PARAM) : q].strip()
            # A value ends at its closing tag; models sometimes omit it before the next one.
            ends = [x for x in (body.find(PARAM_END, q), body.find(PARAM, q)) if x >= 0]
            if fe >= 0:
                ends.append(fe)
            if not ends:
                break
            v = min(ends)
            parts.append(
                f"{json.dumps(pname)}: {json.dumps(self._convert(c.name, pname, body[q + 1 : v]), ensure_ascii=False)}"
            )
            j = v + len(PARAM_END) if body.startswith(PARAM_END, v) else v
        c.arguments = "{" + ", ".join(parts)
        done = body.find(FUNC_END, j) >= 0 or (closed and not body[j:].strip())
        if done:
            c.arguments += "}"
            c.done = True
        return c

    def _convert(self, func: str, param: str, raw: str) -> Any:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        kind = self._param_type(func, param)
        if kind in (None, "string"):
            return raw
        text = raw.strip()
        try:
            if kind == "integer":
                return int(text)
            if kind == "number":
                x = float(text)
                return int(x) if x.is_integer() and "." not in text and "e" not in text else x
            if kind == "boolean":
                if text.lower() in ("true", "false"):
                    return text.lower() == "true"
                return raw
            return json.loads(text)  # object, array, null
        except ValueError:
            return raw

    def _param_type(self, func: str, param: str) -> str | None:
        for t in self.tools:
            f = t.get("function") or {}
            if f.get("name") == func:
                prop = ((f.get("parameters") or {}).get("properties") or {}).get(param) or {}
                kind = prop.get("type")
                if isinstance(kind, list):  # ["integer", "null"]
                    kind = next((k for k in kind if k != "null"), None)
                return kind if isinstance(kind, str) else None
        return None
