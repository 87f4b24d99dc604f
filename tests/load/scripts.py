"""Running a benchmark script the way `python load_tests/NAME.py ARGS` does, in the test
process: its main(ARGS) from the repository root (where its servers and relative paths live).
A subprocess would import torch and transformers again, seconds of every smoke test on a 2-core
CI machine; the servers a script launches are still processes of their own."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_main(script: str, argv: list[str]) -> object:
    """load_tests/<script>.py's main(argv), which must succeed: no exception, and no non-zero
    exit status where main returns one (scripts whose `__main__` ends in sys.exit(main()))."""
    module = importlib.import_module(f"load_tests.{script}")
    with contextlib.chdir(ROOT):
        result = module.main(argv)
    assert not (isinstance(result, int) and result != 0), (
        f"load_tests/{script}.py returned {result}"
    )
    return result
