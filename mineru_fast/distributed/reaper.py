"""Ends what is left of a batch driver's local Ray once the driver is gone, however it ended.

A local Ray (``run_batch`` without a cluster address) is GCS, a raylet, its workers and two agents
(dashboard, runtime env). ``ray.shutdown`` ends them, and Ray's own SIGTERM / SIGINT handlers run
it; a driver killed outright (SIGKILL, the OOM killer) runs nothing, and the two agents then hang
on their way out and stay for good, adopted by init. So the driver starts this process
(``python -m mineru_fast.distributed.reaper MARKER``) with a pipe on its stdin, and starts Ray with
``MARKER_ENV=MARKER`` in the environment, which every Ray process inherits. When the pipe closes
(the driver ended), this waits up to ``GRACE_S`` for them to end by themselves, then SIGKILLs every
process still carrying the marker. Linux only (it reads ``/proc``); elsewhere it just waits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path

__all__ = ["MARKER_ENV", "GRACE_S", "carriers", "main"]

MARKER_ENV = "MINERU_FAST_BATCH_RAY"
GRACE_S = 10.0  # what ray.shutdown takes at most to end its processes, on 2 loaded cores (a few s)


def carriers(marker: str) -> list[int]:
    """Ids of the processes whose environment (as they were started) holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with suppress(OSError):  # ended meanwhile, or not ours to read
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    """Wait for the driver (EOF on stdin), then end what carries the marker (see the module docstring)."""
    (marker,) = sys.argv[1:] if argv is None else argv
    sys.stdin.buffer.read()  # returns at EOF: the driver closed the pipe or is gone
    deadline = time.monotonic() + GRACE_S
    while carriers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in carriers(marker):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
