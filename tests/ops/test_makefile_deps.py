"""The Makefile's first install step (KERNEL_DEPS: what the cc 7.0 compile check imports, so it
can start while pip installs the rest) pins each package exactly as pyproject.toml does."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(spec: str) -> str:
    return re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0].lower()


def test_kernel_deps_match_pyproject():
    line = next(
        ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("KERNEL_DEPS :=")
    )
    kernel_deps = shlex.split(line.split(":=", 1)[1])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {_name(spec): spec for spec in project}
    assert kernel_deps, line
    for spec in kernel_deps:
        assert pinned.get(_name(spec)) == spec, (spec, pinned.get(_name(spec)))
