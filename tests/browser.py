"""Headless Chromium for the chat page's tests (load_tests/headless_chromium.py starts it). A
machine without Debian's chromium and chromium-driver, or without selenium, skips them."""

from __future__ import annotations

from pathlib import Path

import pytest

from load_tests import headless_chromium
from load_tests.headless_chromium import set_viewport  # noqa: F401 - for the tests


def skip_without_chromium() -> None:
    gone = headless_chromium.missing()
    if gone:
        msg = (
            f"no headless browser: {', '.join(gone)} missing (Debian: {headless_chromium.INSTALL})"
        )
        pytest.skip(msg)
    pytest.importorskip("selenium", reason="selenium is in the dev extra: make install")


def start_chromium(profile: Path):
    skip_without_chromium()
    return headless_chromium.start_chromium(profile)


def console_errors(driver) -> list[str]:
    """What the page logged as errors since the last call (a failed script, a CSP refusal)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
