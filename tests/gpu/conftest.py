import sys
from pathlib import Path

# Make the repository root importable so GPU tests share helpers as `tests.<module>`.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
