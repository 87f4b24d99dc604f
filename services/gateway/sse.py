"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
