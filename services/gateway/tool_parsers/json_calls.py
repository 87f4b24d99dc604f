"""A tool call written as a JSON object {"name": ..., "arguments"|"parameters": {...}}, read
from possibly incomplete text (the hermes, llama3_json and mistral formats share it)."""

from __future__ import annotations

import json

from voltserve.services.gateway.tool_parsers.base import PartialCall
from voltserve.services.gateway.tool_parsers.json_scan import object_fields

ARG_KEYS = ("arguments", "parameters")


def json_call(s: str, i: int) -> tuple[PartialCall, int | None]:
    """The call whose object starts at s[i] ('{') and the index past it (None: incomplete).
    ValueError when the text cannot be such a call."""
    fields, end = object_fields(s, i)
    c = PartialCall()
    if "name" in fields and fields["name"][1] is not None:
        st, en = fields["name"]
        name = json.loads(s[st:en])
        if not isinstance(name, str):
            raise ValueError("a tool call's name must be a string")
        c.name = name
    key = next((k for k in ARG_KEYS if k in fields), None)
    if key is not None:
        st, en = fields[key]
        if s[st] == "{":
            # The raw text, as it grows: every character inside the object belongs to it.
            c.arguments = s[st:en] if en is not None else s[st:]
        elif en is not None and s[st] == '"':
            c.arguments = json.loads(s[st:en])  # arguments sent as a JSON-encoded string
        elif en is not None:
            raise ValueError("a tool call's arguments must be an object")
    if end is not None:
        if c.name is None:
            raise ValueError("a tool call without a name")
        if key is None:
            c.arguments = "{}"
        c.done = True
    return c, end
