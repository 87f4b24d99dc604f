"""Errors in Anthropic's shape on the Messages API route:
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.

Every error of the gateway is an OpenAI error object made in one place (the app's middleware:
auth, bad input, 413, model not found, internal errors); this middleware, outside that one,
rewrites those of the Anthropic routes into Anthropic's shape, so the status and the message
stay decided once. Errors inside a stream are written by the stream itself
(messages_output.MessagesStream.error).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

ANTHROPIC_PATHS = frozenset({"/v1/messages"})

# HTTP status -> Anthropic's error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error object. Its errors have no `param`: the message names the field."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


@web.middleware
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    resp = await handler(request)
    if (
        request.path not in ANTHROPIC_PATHS
        or resp.status < 400
        or not isinstance(resp, web.Response)
        or not isinstance(resp.body, bytes)
    ):
        return resp
    try:
        err = json.loads(resp.body)["error"]
        message, param = err["message"], err.get("param")
    except (ValueError, KeyError, TypeError):
        return resp
    out = web.json_response(error_body(resp.status, message, param), status=resp.status)
    if resp.keep_alive is False:  # a 413: its body was left unread, the connection is done
        out.force_close()
    return out
