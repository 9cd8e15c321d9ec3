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


ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _cpuinfo(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's ``key: value`` fields of /proc/cpuinfo (empty where unreadable)."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name, e.g. ``"AMD EPYC 9B14"`` (``"unknown"`` where unreadable)."""
    return _cpuinfo(cpuinfo).get("model name", "unknown")


def isa_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, bool]:
    """Which of ``ISA_FLAGS`` (AVX2 / AVX-512 / VNNI / BF16 / AMX) the CPU reports."""
    flags = set(_cpuinfo(cpuinfo).get("flags", "").split())
    return {flag: flag in flags for flag in ISA_FLAGS}


def numa_nodes(sysfs: Path = Path("/sys/devices/system/node")) -> int:
    """NUMA nodes with CPUs (1 where sysfs has no node directory)."""
    nodes = [d for d in sysfs.glob("node[0-9]*") if (d / "cpulist").is_file() and (d / "cpulist").read_text().strip()]
    return max(1, len(nodes))
