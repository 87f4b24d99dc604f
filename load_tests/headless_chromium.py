"""Debian's `chromium`, headless, driven through Debian's `chromium-driver` by Selenium: for the
chat page's tests (tests/browser.py) and its load benchmark (bench_web_page.py). Nothing is
downloaded: the driver is given by path, so Selenium Manager never runs, and Chromium starts
with its background networking off (on a machine without network access it stalls otherwise).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def missing() -> list[str]:
    """The browser's files that are not installed."""
    return [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]


def start_chromium(profile: Path) -> Any:
    """A Chromium with the profile folder `profile` (fresh: nothing cached); the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, were it ever asked, downloads nothing
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


def set_viewport(
    driver: Any, width: int, height: int, mobile: bool = False, scale: float = 1
) -> None:
    """The page's viewport, exactly (a window size would include the browser's own frame)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile},
    )
    driver.execute_cdp_cmd(
        "Emulation.setTouchEmulationEnabled", {"enabled": mobile, "maxTouchPoints": 5}
    )
