"""Reading an OpenAI-style SSE stream (`data: {...}` lines, `data: [DONE]`) in the load clients."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


class InStreamError(Exception):
    """The server sent an error object inside the stream."""


async def sse_json(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """Yields each data line's JSON object of an aiohttp response until [DONE]."""
    async for raw in resp.content:  # one SSE line at a time
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        obj = json.loads(data)
        if "error" in obj:
            raise InStreamError(f"in-stream error: {obj['error']}")
        yield obj
