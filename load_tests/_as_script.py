"""Imported first by a benchmark script run as a file (`python load_tests/NAME.py`): makes this
folder the package `load_tests`, so scripts import each other as `load_tests.<name>`, as the
tests do, without the checkout's root on sys.path (its kernels/, shared/ and services/ folders
would shadow packages of those names, Hugging Face's `kernels` among them). voltserve itself
comes from its install (`make install`, or the mapping scripts/gpu_check.sh sets up)."""

import sys
import types
from pathlib import Path

if "load_tests" not in sys.modules:
    _package = types.ModuleType("load_tests")
    _package.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["load_tests"] = _package
