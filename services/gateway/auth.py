"""API key check (--api-key): `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's
clients send it. Health and metrics stay open for probes and scrapers, and so does the chat page
(web_ui.py): it holds no secret, and its API calls carry the key the user typed."""

from __future__ import annotations

import hmac

from aiohttp import web
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.web_ui import ASSET_PREFIX, PAGE_PATH

OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", PAGE_PATH})
OPEN_PREFIXES = (ASSET_PREFIX,)


def check_api_key(request: web.Request, api_key: str | None) -> None:
    if (
        not api_key
        or request.path in OPEN_PATHS
        or request.path.startswith(OPEN_PREFIXES)
        or request.method == "OPTIONS"
    ):
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    keys = [token] if scheme.lower() == "bearer" else []
    keys += request.headers.getall("x-api-key", [])
    if not any(hmac.compare_digest(k.strip().encode(), api_key.encode()) for k in keys):
        raise APIError(
            401, "Invalid or missing API key.", type="authentication_error", code="invalid_api_key"
        )
