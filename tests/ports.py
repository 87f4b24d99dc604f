"""TCP ports for the services tests start, safe when several test processes run at once
(pytest-xdist workers, other pytest runs on the same machine).

Ports come from a range below the kernel's ephemeral range, so neither bind(0) nor an outgoing
connection's source port ever takes one, and each is reserved with a lock file that the reserving
process holds until it exits (the kernel drops the lock with the process: nothing goes stale).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

# Below Linux's default ephemeral range (32768-60999): ports the kernel hands to bind(0) and to
# outgoing connections never fall here, so only other reservations can compete for them.
PORT_RANGE = (20000, 32000)
_PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "voltserve-test-ports"
_held_port_locks: list = []  # open lock files: a reservation lasts as long as this process
_next_port: list[int] = []


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other process using this function
    will be handed while this process lives (xdist workers, other pytest runs on the machine)."""
    lo, hi = PORT_RANGE
    if not _next_port:
        # Start each process at its own place in the range so that reservations rarely meet.
        _next_port.append(lo + (os.getpid() * 7919) % (hi - lo))
    _PORT_LOCK_DIR.mkdir(exist_ok=True)
    for _ in range(hi - lo):
        port = _next_port[0]
        _next_port[0] = lo + (port + 1 - lo) % (hi - lo)
        f = open(_PORT_LOCK_DIR / f"{port}.lock", "a")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        if _bindable(port):
            _held_port_locks.append(f)
            return port
        f.close()
    raise RuntimeError(f"no free port in {PORT_RANGE}")
