"""The chat page's routes on a real gateway app in this process (the model's tokenizer, a real
valkey server, no executor needed) under aiohttp's test server: what is served, with which
headers, under --api-key and with --no-web-ui; and `voltserve serve` passing --no-web-ui on.
The page in a browser: test_web_ui.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from voltserve.services import launcher
from voltserve.services.gateway import main as gateway_main
from voltserve.services.gateway.web_ui import WEB_DIR


@pytest.fixture
async def gateway(valkey, tiny_model: Path):
    clients: list[TestClient] = []

    async def start(*flags: str) -> TestClient:
        argv = ["--model", str(tiny_model), "--redis-url", valkey.url, *flags]
        client = TestClient(TestServer(gateway_main.make_app(gateway_main.parse_args(argv))))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()


def page_files() -> list[str]:
    """Every file the page loads: index.html's ui/ links and the modules' imports."""
    index = (WEB_DIR / "index.html").read_text()
    names = set(re.findall(r'(?:src|href)="ui/([^"]+)"', index))
    for js in WEB_DIR.glob("*.js"):
        names |= set(re.findall(r'from "\./([^"]+)"', js.read_text()))
    return sorted(names)


async def test_the_page_and_every_file_it_loads(gateway) -> None:
    client = await gateway()
    r = await client.get("/")
    assert r.status == 200 and r.content_type == "text/html"
    assert await r.read() == (WEB_DIR / "index.html").read_bytes()
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "connect-src 'self'" in csp
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    files = page_files()
    assert {"chat.js", "chat.css", "markdown.js", "api.js", "store.js", "theme.js"} <= set(files)
    types = {".js": "text/javascript", ".css": "text/css"}
    for name in files:
        r = await client.get(f"/ui/{name}", headers={"Accept-Encoding": "gzip"})
        assert r.status == 200, name
        assert r.content_type == types[Path(name).suffix], name
        assert r.headers["Content-Encoding"] == "gzip", name
        assert await r.read() == (WEB_DIR / name).read_bytes(), name


async def test_revalidation_and_unknown_files(gateway) -> None:
    client = await gateway()
    r = await client.get("/ui/chat.js")
    etag = r.headers["ETag"]
    assert r.headers["Cache-Control"] == "no-cache"
    r = await client.get("/ui/chat.js", headers={"If-None-Match": etag})
    assert r.status == 304 and await r.read() == b""
    r = await client.get("/ui/chat.js", headers={"If-None-Match": '"other"'})
    assert r.status == 200
    for path in ("/ui/missing.js", "/ui/..%2Fweb_ui.py", "/ui/", "/index.html", "/ui/index.html"):
        assert (await client.get(path)).status == 404, path


async def test_the_page_is_open_under_an_api_key_and_the_api_is_not(gateway) -> None:
    client = await gateway("--api-key", "k")
    assert (await client.get("/")).status == 200
    assert (await client.get("/ui/chat.js")).status == 200
    r = await client.get("/v1/models")
    assert r.status == 401
    assert (await r.json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer k"})).status == 200
    # Past the page's own paths the key is asked for, existing route or not.
    assert (await client.get("/ui-not")).status == 401


async def test_no_web_ui_leaves_the_api_alone(gateway) -> None:
    client = await gateway("--no-web-ui")
    assert (await client.get("/")).status == 404
    assert (await client.get("/ui/chat.js")).status == 404
    r = await client.get("/v1/models")
    assert r.status == 200 and (await r.json())["object"] == "list"


@pytest.mark.parametrize("flags", [[], ["--no-web-ui"]])
def test_serve_passes_no_web_ui_to_the_gateway(flags: list[str]) -> None:
    args = launcher.build_parser().parse_args(["--model", "m", *flags])
    (gw,) = [c for c in launcher.build_children(args, "redis://x") if c.name == "gateway"]
    assert gateway_main.parse_args(gw.argv[1:]).no_web_ui == bool(flags)


def test_the_page_ships_in_the_package() -> None:
    # setuptools' package-data globs do not descend: the page's files sit in web/ itself.
    pyproject = tomllib.loads((WEB_DIR.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["voltserve.services.gateway"]
    assert "web/*" in patterns
    assert all(p.is_file() for p in WEB_DIR.iterdir())
