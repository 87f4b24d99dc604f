"""A small scanner over possibly incomplete JSON text: where values start and end, so a streamed
tool call can hand out the raw text of its arguments as it arrives. Parsing of complete values
is left to the json module; this only finds boundaries."""

from __future__ import annotations

WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """s[i] == '"': index just past the closing quote, or None if the string is incomplete."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i], or None if it is incomplete.

    Scalars (numbers, true/false/null) end at a delimiter; at the end of the text they count
    as incomplete, since more digits may follow."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in WS + ",]}":
        j += 1
    return j if j < len(s) else None


def object_fields(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Top-level fields of the object starting at s[i] ('{'): {key: (value start, value end or
    None while incomplete)} for every key whose value has started, and the index past the
    closing brace (None while the object is incomplete)."""
    import json

    fields: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(s, i + 1)
    while j < len(s):
        if s[j] == "}":
            return fields, j + 1
        if s[j] == ",":
            j = skip_ws(s, j + 1)
            continue
        if s[j] != '"':
            raise ValueError(f"expected a key at {j}")
        e = string_end(s, j)
        if e is None:
            return fields, None
        key = json.loads(s[j:e])
        j = skip_ws(s, e)
        if j >= len(s):
            return fields, None
        if s[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return fields, None
        end = value_end(s, j)
        fields[key] = (j, end)
        if end is None:
            return fields, None
        j = skip_ws(s, end)
    return fields, None
