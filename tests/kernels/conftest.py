"""The cc 7.0 compile check, run once per test session and shared by every test that needs a
kernel compiled for Volta: `voltserve check-kernels --cc 7.0` compiles every registered
signature (in parallel, one worker per CPU), writes each PTX and the results as JSON, and the
tests read those instead of compiling again.

Its tests carry the `cc70` xdist group (one worker runs them, so the check runs once) and the
`slow` mark (`make test-fast` leaves them out; `make test` runs them first, see tests/conftest.py).
Their timeout is the check's (the fixture's setup is one long compile of every kernel).

`make test` starts the check itself, in the background, as soon as the packages the kernels
import are installed, so that it compiles while pip installs the rest on a machine whose other
cores are idle: VOLTSERVE_CC70_CHECK_DIR names the folder it writes (stdout, stderr, results,
PTX, and `returncode` last), and the fixture waits for that instead of compiling again. A
folder older than a kernel source is refused (it would be another tree's check).

Every test here also runs with a short interpreter switch interval while numba's CUDA simulator
is in use (`_simulator_switch_interval`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from voltserve.kernels.runtime.numba_common import SIM

from voltserve.cli import command as voltserve_command

# The simulator runs a block's threads as Python threads that meet at every syncthreads (its warp
# shuffles are built from them) while the launching thread polls them in a loop. At the default
# 5 ms interval most of a launch is threads waiting for the GIL that the polling thread holds:
# measured on 2 cores, a fused quantized-MoE case took 17.6 s at 5 ms and 6.9 s at 0.1 ms, an
# online-merge decode case 30.3 s and 2.7 s. Shorter intervals gained nothing more.
SIM_SWITCH_INTERVAL_S = 1e-4
_shared_lock = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """numba's FakeCUDAShared.array with its allocation made atomic. numba looks the call site's
    array up and creates it on a miss, unlocked: a thread switched out between the two makes a
    second array, and the writes of the threads holding one are lost to those holding the other
    (seen as wrong in-kernel attention merges once threads switch often). Keyed by the caller's
    file and line, as numba keys it."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    if alignment is not None or shape == 0:
        return _numba_shared_array(self, shape, dtype, alignment)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _shared_lock:
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
    return res


if SIM:
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    _numba_shared_array = FakeCUDAShared.array


@pytest.fixture(autouse=True)
def _simulator_switch_interval(monkeypatch: pytest.MonkeyPatch):
    """The short switch interval for this test (simulator only), restored after it, with the
    simulator's shared arrays allocated atomically (`_shared_array`)."""
    if not SIM:
        yield
        return
    monkeypatch.setattr(FakeCUDAShared, "array", _shared_array)
    default = sys.getswitchinterval()
    sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(default)


@dataclass
class CheckRun:
    returncode: int
    stdout: str
    stderr: str
    results: list[dict]  # kernels/runtime/check.py Result fields, registry order
    ptx_dir: Path

    def ptx(self, name: str, signature: str) -> str:
        from voltserve.kernels.runtime.check import _ptx_file

        return _ptx_file(str(self.ptx_dir), name, signature).read_text()

    def result(self, name: str, signature: str) -> dict:
        (r,) = [r for r in self.results if r["name"] == name and r["signature"] == signature]
        return r


CHECK_TIMEOUT_S = 2300
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def _started_check(folder: Path) -> CheckRun:
    """The result of the check `make test` started in the background (see the module doc)."""
    deadline = time.monotonic() + CHECK_TIMEOUT_S
    rc_file = folder / "returncode"
    while not rc_file.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the cc 7.0 check started by make test wrote no {rc_file} in time")
        time.sleep(1.0)
    sources = [p for p in KERNELS_DIR.rglob("*.*") if "__pycache__" not in p.parts]
    newest_source = max(p.stat().st_mtime for p in sources)
    if (folder / "stdout").stat().st_mtime < newest_source:
        pytest.fail(f"{folder} is older than the kernel sources: a stale cc 7.0 check")
    path = folder / "results.json"
    results = json.loads(path.read_text()) if path.exists() else []
    return CheckRun(
        int(rc_file.read_text().strip() or 1),
        (folder / "stdout").read_text(),
        (folder / "stderr").read_text(),
        results,
        folder / "ptx",
    )


@pytest.fixture(scope="session")
def cc70_check(tmp_path_factory: pytest.TempPathFactory) -> CheckRun:
    started = os.environ.get("VOLTSERVE_CC70_CHECK_DIR")
    if started:
        return _started_check(Path(started))
    out = tmp_path_factory.mktemp("cc70")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # must compile for real, not simulate
    cmd = [*voltserve_command(), "check-kernels", "--cc", "7.0"]
    cmd += ["--json", str(out / "results.json"), "--ptx-dir", str(out / "ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHECK_TIMEOUT_S)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else []
    return CheckRun(proc.returncode, proc.stdout, proc.stderr, results, out / "ptx")
