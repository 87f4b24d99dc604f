"""startup.freeze_heap: what a service holds after start-up leaves the collector's passes.

Run in a child process: freezing is process-wide and would change this test process's
collector for every later test."""

import subprocess
import sys

CHILD = """
import gc
from voltserve.shared import startup

held = [[i] for i in range(50_000)]  # containers alive after "start-up"
assert gc.get_freeze_count() == 0
n = startup.freeze_heap()
assert n == gc.get_freeze_count(), (n, gc.get_freeze_count())
assert n >= len(held), n
# A full pass now walks only what was made after the freeze: the 50,000 lists are not in it.
late = [[i] for i in range(10)]
assert not any(o is held[0] for o in gc.get_objects(generation=2))
assert any(o is late[0] for o in gc.get_objects())
print("frozen", n)
"""


def test_freeze_heap_moves_live_objects_out_of_collections():
    r = subprocess.run(
        [sys.executable, "-P", "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("frozen ")
