"""Where voltserve keeps files between runs: compiled kernels, the embedded broker's data."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "VOLTSERVE_CACHE_DIR"


def cache_root() -> Path:
    """$VOLTSERVE_CACHE_DIR, else ~/.cache/voltserve (XDG_CACHE_HOME respected)."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "voltserve"
