"""A stand-in for ``mineru-fast`` in launcher tests: ``fake_worker.py parse [options] in_*...``.

For each argument starting with ``in_`` it prints ``<input>: success, cpus <affinity>`` as
``parse`` does, except that an input named ``in_crash*`` kills the process before reporting it
and one named ``in_full*`` ends it with parse's output-error status (4), as a full disk would.
"""

import os
import signal
import sys

for arg in sys.argv[2:]:
    if not arg.startswith("in_"):
        continue
    if arg.startswith("in_crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    if arg.startswith("in_full"):
        sys.exit(4)
    print(f"{arg}: success, cpus {sorted(os.sched_getaffinity(0))}", flush=True)
