import os
import random
import sys
from pathlib import Path

import pytest

# Make the repository root importable so tests can share helpers as `tests.<module>`
# (tests/checkpoints.py, tests/engine/kv_echo_runner.py).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture
def rng() -> random.Random:
    """Fresh random inputs every run; the seed is printed, so a failure can be replayed with
    VOLTSERVE_TEST_SEED=<seed>."""
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return random.Random(seed)
