"""CPU facts the runtime needs: how many physical cores this process may use."""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores_available(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted once).

    Falls back to the number of allowed logical CPUs when sysfs topology is unavailable.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        siblings = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(allowed)
    return max(1, len(cores))
