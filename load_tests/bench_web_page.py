"""The chat page's weight and first paint, as a first-time visitor gets them: the page at URL
opened RUNS times in headless Chromium (load_tests/headless_chromium.py), each time with a fresh
profile, so nothing is cached. From the browser's Resource and Paint Timing:

- the bytes transferred for the page's own files (the HTML at / and its files under /ui/,
  response headers included, compressed as the gateway sends them), and their size unpacked;
  the page's API calls (v1/models) are counted apart;
- first paint and first contentful paint, DOMContentLoaded and the load event, in ms from the
  start of the navigation (medians over the runs, and every run).

    make serve   # in another terminal
    python load_tests/bench_web_page.py --url http://127.0.0.1:8000 --runs 5 \\
        --out load_tests/results/cpu/web_page.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import env_info, write_json  # noqa: E402
from load_tests.headless_chromium import set_viewport, start_chromium  # noqa: E402

TIMING = """
const nav = performance.getEntriesByType('navigation')[0];
const done = nav && nav.loadEventEnd > 0;
const paint = Object.fromEntries(performance.getEntriesByType('paint').map((p) => [p.name, p.startTime]));
const entry = (e) => ({url: e.name, transfer: e.transferSize, encoded: e.encodedBodySize,
                       decoded: e.decodedBodySize});
return {done, paint, nav: nav && {...entry(nav), dcl: nav.domContentLoadedEventEnd, load: nav.loadEventEnd},
        resources: performance.getEntriesByType('resource').map(entry)};
"""
WAIT_S = 30.0


def one_load(url: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="voltserve-web-bench-") as profile:
        driver = start_chromium(Path(profile))
        try:
            set_viewport(driver, 1280, 800)
            driver.get(url.rstrip("/") + "/")
            deadline = time.monotonic() + WAIT_S
            while True:
                t = driver.execute_script(TIMING)
                asked = any("/v1/models" in r["url"] for r in t["resources"])
                if t["done"] and "first-contentful-paint" in t["paint"] and asked:
                    return t
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the page did not finish loading in {WAIT_S} s: {t}")
                time.sleep(0.05)
        finally:
            driver.quit()


def file_name(url: str) -> str:
    path = urlparse(url).path
    return "index.html" if path == "/" else path.rsplit("/", 1)[-1]


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(url: str, runs: int) -> dict[str, Any]:
    loads = [one_load(url) for _ in range(runs)]
    first = loads[0]
    page = [first["nav"]] + [
        r for r in first["resources"] if urlparse(r["url"]).path.startswith("/ui/")
    ]
    api = [r for r in first["resources"] if "/v1/" in urlparse(r["url"]).path]
    files = {
        file_name(f["url"]): {k: f[k] for k in ("transfer", "encoded", "decoded")} for f in page
    }
    return {
        "url": url,
        "runs": runs,
        "page": {
            "files": files,
            "transfer_bytes": sum(f["transfer"] for f in files.values()),
            "decoded_bytes": sum(f["decoded"] for f in files.values()),
        },
        "api_transfer_bytes": sum(r["transfer"] for r in api),
        "first_paint_ms": summary([x["paint"]["first-paint"] for x in loads]),
        "first_contentful_paint_ms": summary([x["paint"]["first-contentful-paint"] for x in loads]),
        "dom_content_loaded_ms": summary([x["nav"]["dcl"] for x in loads]),
        "load_ms": summary([x["nav"]["load"] for x in loads]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    result = measure(args.url, args.runs) | {"env": env_info()}
    page = result["page"]
    print(
        f"page: {page['transfer_bytes']} bytes transferred ({page['decoded_bytes']} unpacked) "
        f"in {len(page['files'])} files; first contentful paint "
        f"{result['first_contentful_paint_ms']['median']:.0f} ms (median of {args.runs})"
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
