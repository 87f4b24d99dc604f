"""The cc 7.0 compile check, run once per test session and shared by every test that needs a
kernel compiled for Volta: `voltserve check-kernels --cc 7.0` compiles every registered
signature (in parallel, one worker per CPU), writes each PTX and the results as JSON, and the
tests read those instead of compiling again.

Its tests carry the `cc70` xdist group (one worker runs them, so the check runs once) and the
`slow` mark (`make test-fast` leaves them out; `make test` runs them first, see tests/conftest.py).
Their timeout is the check's (the fixture's setup is one long compile of every kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class CheckRun:
    returncode: int
    stdout: str
    stderr: str
    results: list[dict]  # kernels/check.py Result fields, registry order
    ptx_dir: Path

    def ptx(self, name: str, signature: str) -> str:
        from voltserve.kernels.check import _ptx_file

        return _ptx_file(str(self.ptx_dir), name, signature).read_text()

    def result(self, name: str, signature: str) -> dict:
        (r,) = [r for r in self.results if r["name"] == name and r["signature"] == signature]
        return r


@pytest.fixture(scope="session")
def cc70_check(tmp_path_factory: pytest.TempPathFactory) -> CheckRun:
    out = tmp_path_factory.mktemp("cc70")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # must compile for real, not simulate
    cmd = [sys.executable, "-m", "voltserve.cli", "check-kernels", "--cc", "7.0"]
    cmd += ["--json", str(out / "results.json"), "--ptx-dir", str(out / "ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=2300)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else []
    return CheckRun(proc.returncode, proc.stdout, proc.stderr, results, out / "ptx")
