"""How busy the machine was while a benchmark ran: other processes' CPU time, and the load average.

Timings from a machine shared with other work are slower than the machine is; a report states
how much other work there was. ``LoadMonitor`` measures it over a run:

- **other processes' CPU**: the CPU seconds this process's CPUs (its affinity mask) spent busy
  (``/proc/stat``: user, nice, system, irq, softirq and steal ticks of each) minus those of this process and its
  children (``resource.getrusage`` of itself and of reaped children, plus ``/proc/<pid>/stat`` of
  live descendants), as cores kept busy on average (CPU seconds / wall seconds). Linux only; None
  elsewhere.
- **load average**: ``os.getloadavg()`` (1, 5, 15 minutes) at the start and the end. It counts
  this run's own threads too, so it is context, not the verdict.

A run is *not idle* when other processes kept more than ``BUSY_CORES`` cores busy on average.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_CORES = 0.25  # other processes' average busy cores above which a run is reported as not idle
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu line: user nice system [idle iowait] irq softirq steal


def machine_busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds the CPUs ``cpus`` have spent busy since boot (``/proc/stat``), or None without it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total, found = 0, False
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(v) for v in values]
            total += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
            found = True
    return total / os.sysconf("SC_CLK_TCK") if found else None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(v) for v in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def _stat_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a live process (``/proc/<pid>/stat``), 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; utime is field 14 of the line
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    pending, seen = _children(os.getpid()), set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _stat_seconds(pid)
        pending += _children(pid)
    return total


@dataclass(frozen=True)
class LoadReport:
    """The machine's load over one run.

    Attributes:
        wall_s: seconds measured.
        cpus: CPUs this process may run on (its affinity mask).
        other_cores: cores other processes kept busy on average (None: ``/proc/stat`` unreadable).
        loadavg_start / loadavg_end: ``os.getloadavg()`` at the start and the end (1, 5, 15 min).
    """

    wall_s: float
    cpus: int
    other_cores: float | None
    loadavg_start: tuple[float, float, float]
    loadavg_end: tuple[float, float, float]

    @property
    def idle(self) -> bool | None:
        """Whether other processes stayed under ``BUSY_CORES`` cores (None: not measurable)."""
        return None if self.other_cores is None else self.other_cores <= BUSY_CORES

    def to_dict(self) -> dict:
        """JSON-ready form, with ``idle``."""
        return {
            "wall_s": self.wall_s,
            "cpus": self.cpus,
            "other_cores": self.other_cores,
            "loadavg_start": list(self.loadavg_start),
            "loadavg_end": list(self.loadavg_end),
            "idle": self.idle,
            "busy_threshold_cores": BUSY_CORES,
        }


def describe(load: dict) -> list[str]:
    """Report lines for a ``LoadReport.to_dict()``: the figures, and a warning when not idle."""
    start, end = (" / ".join(f"{v:.2f}" for v in load[k]) for k in ("loadavg_start", "loadavg_end"))
    other = load["other_cores"]
    measured = "not measurable here (no /proc/stat)" if other is None else f"{other:.2f} of {load['cpus']} cores"
    lines = [
        f"- machine load during the run: other processes kept {measured} busy on average; "
        f"load average (1/5/15 min) {start} at the start, {end} at the end"
    ]
    if load["idle"] is False:
        lines.append(
            f"- **WARNING: the machine was not idle** (other processes used {other:.2f} cores on average, "
            f"over {load['busy_threshold_cores']}): every time in this report is slower than this machine "
            "alone gives; compare only figures from this run, and rerun on a quiet machine for absolute ones"
        )
    return lines


class LoadMonitor:
    """Measures the machine's load between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._busy0: float | None = None
        self._own0 = 0.0
        self._load0 = (0.0, 0.0, 0.0)
        self._cpus: set[int] = set()

    def start(self) -> LoadMonitor:
        """Take the starting sample; returns self."""
        self._load0, self._cpus = os.getloadavg(), os.sched_getaffinity(0)
        self._busy0, self._own0, self._t0 = machine_busy_seconds(self._cpus), own_cpu_seconds(), time.monotonic()
        return self

    def stop(self) -> LoadReport:
        """The load since ``start()``."""
        busy, own, wall = machine_busy_seconds(self._cpus), own_cpu_seconds(), time.monotonic() - self._t0
        other = None
        if busy is not None and self._busy0 is not None and wall > 0:
            other = max(0.0, (busy - self._busy0) - (own - self._own0)) / wall
        return LoadReport(wall, len(self._cpus), other, self._load0, os.getloadavg())
