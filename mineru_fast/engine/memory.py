"""Process memory: keep page-sized buffers out of glibc's heap, give freed heap memory back to the
OS; read this process's resident and peak sizes and how much of a tensor's memory mapping is
resident.

Swapping hundreds of float linears for int8 ones frees many mid-sized tensors. glibc keeps such
freed blocks in its heap (its mmap threshold rises with each large free), so without a trim the
resident size during loading grows to several times the live weights: measured on the full-size
model, 20 vision-sized layers quantized with ``torch.ao`` took 666 MB resident before
``malloc_trim`` and 160 MB after (131 MB of int8 weights).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to trim
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20  # 4 MiB: below one rendered page (1700x2200 RGB = 11.2 MB at 200 DPI)


@functools.cache
def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``nbytes`` or more from its own memory mapping, for the rest of
    the process (glibc's ``mallopt(M_MMAP_THRESHOLD)``; once per process).

    glibc raises its threshold to the size of each large block freed (up to 32 MiB), so after the
    first page image (11 MB) is freed, later page images, layout inputs and crop batches come from
    the heap, where they fragment it: over a 300-page CLI run on the tiny model the peak resident
    size rose from 1.04 to 1.06 GB, against a flat 0.92 GB with the threshold pinned (at 1 MiB)
    (``benchmarks/README.md``, "Long documents"). Pinning it also fixes glibc's trim threshold, so
    ``trim_heap`` still returns freed heap tops.

    Returns:
        True when set; False where libc is not glibc, or where the user set
        ``$MALLOC_MMAP_THRESHOLD_`` (glibc's own variable, which then stays in charge).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, nbytes) == 1)


def trim_heap() -> bool:
    """Return free heap pages to the OS (``malloc_trim(0)``); False where libc has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes.

    On Linux the high-water mark of its own address space (``VmHWM`` in ``/proc/self/status``):
    ``ru_maxrss`` would be wrong for a child process, since Linux carries the parent's resident size
    at fork time into it (a bench row spawned by a 3.6 GB parent reported 3.6 GB whatever it used).
    Elsewhere ``ru_maxrss`` (bytes on macOS, kilobytes on other systems).
    """
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource  # POSIX only: imported here so Windows can still import this module

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident set size now, in bytes (``VmRSS``); None where /proc is missing."""
    return _status_bytes("VmRSS")


def resident_bytes(tensors: list[torch.Tensor]) -> int | None:
    """Bytes of the memory mappings holding ``tensors``' data that are resident now (the ``Rss``
    of each distinct mapping in ``/proc/self/smaps``: a lazily committed KV buffer or a
    memory-mapped embedding table counts only the pages in use). None where /proc is missing."""
    starts = sorted({t.data_ptr() for t in tensors})
    total, current, seen = 0, None, set()
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(x, 16) for x in head.split("-"))
                    current = (low, high) if any(low <= s < high for s in starts) else None
                elif head == "Rss:" and current is not None and current not in seen:
                    seen.add(current)
                    total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return total
