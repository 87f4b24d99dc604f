"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # the C string escaper json.dumps uses
from typing import Any

from aiohttp import web
from voltserve.services.gateway.errors import APIError

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    """Strict JSON: a NaN or infinity (which Python's json would write as a bare NaN, not JSON)
    is refused with a 500 instead of reaching a client."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as e:
        raise APIError(500, f"the response cannot be written as JSON: {e}") from e


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


class ChunkTemplate:
    """The bytes of a one-choice streaming chunk without logprobs, built from pre-encoded pieces.

    Exactly what `event(chunk)` gives for the same chunk dict (same key order, same escaping),
    but the fixed part (id, object, created, model) is encoded once per request instead of once
    per token: this runs for every request at every engine step.
    """

    def __init__(self, head: dict[str, Any], chat: bool, include_usage: bool) -> None:
        # head: {"id", "object", "created", "model"} in that order; "choices" follows.
        self.prefix = "data: " + dumps(head)[:-1] + ',"choices":[{"index":'
        self.chat = chat
        self.suffix = (',"usage":null' if include_usage else "") + "}\n\n"

    def choice(self, index: int, text: str, finish_reason: str | None) -> bytes:
        finish = "null" if finish_reason is None else encode_basestring(finish_reason)
        if self.chat:
            delta = '{"content":' + encode_basestring(text) + "}" if text else "{}"
            body = f'{index},"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]'
        else:
            body = (
                f'{index},"text":{encode_basestring(text)},"logprobs":null,'
                f'"finish_reason":{finish}}}]'
            )
        return (self.prefix + body + self.suffix).encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
            "X-Accel-Buffering": "no",  # proxies must not buffer the stream
        },
    )
    await resp.prepare(request)
    return resp
