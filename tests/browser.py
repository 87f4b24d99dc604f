"""Headless Chromium for the chat page's tests: Debian's `chromium` driven by Debian's
`chromium-driver` through Selenium. Nothing is downloaded: the driver is given by path, so
Selenium Manager never runs, and Chromium starts with its background networking off (without
network access it would otherwise stall). A machine without the two packages skips.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def skip_without_chromium() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} missing (Debian: {INSTALL})")
    pytest.importorskip("selenium", reason="selenium is in the dev extra: make install")


def start_chromium(profile: Path):
    """A Chromium with a fresh profile folder; the caller quits it."""
    skip_without_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, were it ever asked, downloads nothing
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


def set_viewport(driver, width: int, height: int, mobile: bool = False, scale: float = 1) -> None:
    """The page's viewport, exactly (a window size would include the browser's own frame)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile},
    )
    driver.execute_cdp_cmd(
        "Emulation.setTouchEmulationEnabled", {"enabled": mobile, "maxTouchPoints": 5}
    )


def console_errors(driver) -> list[str]:
    """What the page logged as errors since the last call (a failed script, a CSP refusal)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
