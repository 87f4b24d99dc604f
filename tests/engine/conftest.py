import sys
from pathlib import Path

# Make the repository root importable so tests can share helpers as `tests.<module>`
# (tests/checkpoints.py, tests/engine/kv_echo_runner.py).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
