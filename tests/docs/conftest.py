import sys
from pathlib import Path

# Make the repository root importable so these tests share their Markdown reader as
# `tests.docs.markdown` and import `load_tests.*` scripts to read their parsers.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
