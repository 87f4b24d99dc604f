"""Bearer-token check (--api-key). Health and metrics stay open for probes and scrapers."""

from __future__ import annotations

import hmac

from aiohttp import web
from voltserve.services.gateway.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})


def check_api_key(request: web.Request, api_key: str | None) -> None:
    if not api_key or request.path in OPEN_PATHS or request.method == "OPTIONS":
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise APIError(
            401, "Invalid or missing API key.", type="authentication_error", code="invalid_api_key"
        )
