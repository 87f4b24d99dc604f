"""Bounds on a request body, before any of its fields is read: its size and its JSON nesting.

The size limit (--max-request-bytes) applies to every route. A body whose Content-Length is past
it gets a 413 without being read; a chunked one is read up to the limit and no further. The
answer says `Connection: close`, and what the client still sends is discarded for at most
DRAIN_S seconds (so that a client busy sending reads the 413 instead of a reset), then the
connection is closed.

The default limit follows from the model's longest context (render.position_limit, which bounds
the context every executor enforces; the gateway sizes it at start-up, before any executor has
published): enough for that many tokens of the longest token's text, JSON-escaped, plus room for
the rest of a request (sampling fields, tools, a schema). A larger body could not hold a prompt
that fits.
"""

from __future__ import annotations

import argparse
from typing import Any

from aiohttp import web
from voltserve.services.gateway.errors import APIError

# JSON bytes per UTF-8 byte of text at most, for text a client's JSON encoder escapes: \uXXXX
# (6 bytes) for a 2- or 3-byte character, two of them for a 4-byte one.
JSON_BYTES_PER_TEXT_BYTE = 3
# Everything of a request that is not its prompt's text.
REQUEST_OVERHEAD_BYTES = 1 << 20
# Containers nested in a request body (the body itself is the first level). Deeper structures
# serve no request and cost every recursive reader (a 400-level JSON schema takes xgrammar
# seconds to build; a 64-level one, milliseconds).
MAX_JSON_DEPTH = 64
DRAIN_S = 2.0


def default_max_request_bytes(max_model_len: int, max_token_bytes: int) -> int:
    return max_model_len * max_token_bytes * JSON_BYTES_PER_TEXT_BYTE + REQUEST_OVERHEAD_BYTES


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's request bounds (`voltserve serve` passes them on)."""
    p.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=None,
        help="largest request body; past it a 413 (default: the model's longest context x the "
        "longest "
        f"token's UTF-8 bytes x {JSON_BYTES_PER_TEXT_BYTE} + 1 MiB)",
    )


def request_flags_argv(args: argparse.Namespace) -> list[str]:
    return ["--max-request-bytes", str(args.max_request_bytes)] if args.max_request_bytes else []


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes")


def check_content_length(request: web.Request, limit: int) -> None:
    """413 for a body announced larger than the limit, before any of it is read."""
    n = request.content_length
    if n is not None and n > limit:
        raise too_large(limit)


def check_depth(raw: bytes, body: dict[str, Any], limit: int = MAX_JSON_DEPTH) -> None:
    """400 naming the top-level field whose value nests deeper than `limit` levels. A body
    with fewer opening brackets than that cannot, and is not walked."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    key = deepest_field(body, limit)
    if key is not None:
        raise APIError(
            400, f"{key} is nested more than {limit} levels deep in the request body", param=key
        )


def deepest_field(body: dict[str, Any], limit: int = MAX_JSON_DEPTH) -> str | None:
    """The first top-level field whose value takes the body past `limit` levels of nesting."""
    for key, value in body.items():
        if nests_deeper(value, limit - 1):
            return str(key)
    return None


def nests_deeper(x: Any, limit: int) -> bool:
    """Whether x holds more than `limit` levels of lists and objects (x itself is level 1)."""
    if not isinstance(x, (dict, list)):
        return False
    stack = [(x, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
