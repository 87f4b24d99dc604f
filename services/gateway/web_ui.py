"""The browser chat page: `GET /` and its assets under `/ui/`, read from web/ beside this file.

The page is static and holds no secret, so it is served without a key even under `--api-key`
(auth.OPEN_PATHS, auth.OPEN_PREFIXES); every API call the page makes carries the key the user
typed, under the same rules as any other client. `--no-web-ui` leaves these routes out.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).resolve().parent / "web"
PAGE_PATH = "/"
ASSET_PREFIX = "/ui/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
INDEX = "index.html"
# Model output is rendered as HTML by the page's own Markdown renderer, which escapes first;
# the policy is the second wall: no script but the page's own files, no request to another origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load: a new version of voltserve is seen at once.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str

    @classmethod
    def read(cls, path: Path) -> Asset:
        body = path.read_bytes()
        return cls(body, CONTENT_TYPES[path.suffix], f'"{hashlib.sha256(body).hexdigest()[:20]}"')


def load_assets(folder: Path = WEB_DIR) -> dict[str, Asset]:
    """Every file of the page, by name, read once at start-up (a missing page is an error)."""
    assets = {p.name: Asset.read(p) for p in sorted(folder.iterdir()) if p.suffix in CONTENT_TYPES}
    if INDEX not in assets:
        raise FileNotFoundError(f"the chat page is missing: no {INDEX} in {folder}")
    return assets


def _respond(request: web.Request, asset: Asset) -> web.Response:
    headers = {**SECURITY_HEADERS, "ETag": asset.etag}
    if request.headers.get("If-None-Match") == asset.etag:
        return web.Response(status=304, headers=headers)
    resp = web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})
    resp.enable_compression()  # gzip or deflate when the browser accepts it
    return resp


def add_routes(app: web.Application) -> None:
    assets = load_assets()

    async def index(request: web.Request) -> web.Response:
        return _respond(request, assets[INDEX])

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        found = assets.get(name) if name != INDEX else None  # the page itself only at /
        if found is None:
            raise web.HTTPNotFound()
        return _respond(request, found)

    app.router.add_get(PAGE_PATH, index)
    app.router.add_get(ASSET_PREFIX + "{name}", asset)


def add_web_ui_flag(p: argparse.ArgumentParser) -> None:
    """The gateway's flag; `voltserve serve` declares it through this and passes it on."""
    p.add_argument(
        "--no-web-ui",
        action="store_true",
        help="do not serve the browser chat page at / (the API is unchanged)",
    )


def web_ui_flag_argv(args: argparse.Namespace) -> list[str]:
    return ["--no-web-ui"] if args.no_web_ui else []
