"""Thread policy: how many threads torch and OpenMP use, and how OpenMP threads are placed.

- intra-op threads: an explicit ``threads``, else the user's ``OMP_NUM_THREADS``, else the physical
  cores this process may use (``Topology.usable_cores``: SMT siblings once, affinity and cgroup
  quota honoured). One thread per core: a second thread on an SMT sibling shares the core's
  vector units and slows GEMMs down.
- inter-op threads: 1. The engine issues no parallel ops of its own (no ``torch.jit.fork``), so a
  larger inter-op pool only adds idle threads.
- OpenMP variables, set in the environment before torch loads its OpenMP runtime (which reads them
  once, at load): ``OMP_NUM_THREADS``, and with ``bind`` when the threads fill every physical core
  of the affinity mask (one per core): ``OMP_PROC_BIND=close`` +
  ``OMP_PLACES=cores`` for GNU OpenMP (torch's own), ``KMP_AFFINITY`` + ``KMP_BLOCKTIME=1`` when
  Intel OpenMP is loaded (``LD_PRELOAD``-ed ``libiomp5``). Fewer threads than that (``--threads 1``
  on a larger mask, or a CPU quota below the mask) are not bound: binding places them on the
  mask's first cores, so two such processes would share those cores while the others idle.
  ``launch`` narrows each process's mask to its own cores first, so its workers are bound.

A variable the user set is never changed; the plan records it as kept, and the log says so.

One thread runs the engine's multi-threaded torch work: GNU OpenMP gives every thread that starts
a parallel region its own worker pool, and once the pools' threads outnumber the CPUs, every pool
stops spinning between regions (``gomp_throttled_spin_count_var``) and parks its workers in the
kernel after each op instead. Measured on 2 cores, full-size model, each pair in one process: the
vision encoder over 16 crops took 21.8 s in a second thread holding the only pool, 24.2 s once the
main thread had a pool too; the engine decoded 400 replayed tokens in 10.1 s, then 11.7-12.9 s
(``benchmarks/openmp_pools.py``). So the engine is built in a thread that exits afterwards
(``in_fresh_thread``, its pool goes with it) and other threads' torch work runs single-threaded
(``one_torch_thread``): no pool there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from mineru_fast.runtime.cpu import Topology, read_topology

logger = logging.getLogger(__name__)

INTER_OP_THREADS = 1
T = TypeVar("T")
GNU_BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
INTEL_BINDING = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


@dataclass(frozen=True)
class ThreadPlan:
    """What the policy chose for one process.

    Attributes:
        intra_op: torch intra-op (OpenMP) threads.
        inter_op: torch inter-op threads.
        openmp: the OpenMP runtime the variables target, ``"gnu"`` or ``"intel"``.
        env: variables the policy sets (none of them set by the user).
        kept: variables the policy would set but the user already had, with the user's values.
    """

    intra_op: int
    inter_op: int
    openmp: str
    env: dict[str, str]
    kept: dict[str, str]

    def describe(self) -> str:
        """One line for logs: threads, runtime, variables set and kept."""
        parts = [f"intra-op {self.intra_op}", f"inter-op {self.inter_op}", f"OpenMP {self.openmp}"]
        if self.env:
            parts.append("set " + " ".join(f"{k}={v}" for k, v in self.env.items()))
        if self.kept:
            parts.append("kept user-set " + " ".join(f"{k}={v}" for k, v in self.kept.items()))
        return "threads: " + ", ".join(parts)


def detect_openmp(environ: Mapping[str, str] = os.environ, maps: Path = Path("/proc/self/maps")) -> str:
    """``"intel"`` when Intel OpenMP (libiomp5) is preloaded or mapped into this process, else ``"gnu"``."""
    if "libiomp" in environ.get("LD_PRELOAD", ""):
        return "intel"
    try:
        return "intel" if "libiomp" in maps.read_text() else "gnu"
    except OSError:
        return "gnu"


def _user_threads(environ: Mapping[str, str]) -> int | None:
    value = environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def plan_threads(
    topology: Topology,
    threads: int | None = None,
    environ: Mapping[str, str] = os.environ,
    openmp: str | None = None,
    bind: bool = True,
) -> ThreadPlan:
    """The thread plan for a process on ``topology``.

    Args:
        topology: the CPUs the process may use (``cpu.read_topology()``).
        threads: explicit intra-op threads (e.g. ``--threads``); wins over everything.
        environ: the process environment, read for user-set variables (never modified here).
        openmp: ``"gnu"`` or ``"intel"``; detected when None.
        bind: also place OpenMP threads one per core, where they fill every allowed physical
            core (see the module docstring). Leave it off in a process that starts other
            processes after running torch: binding pins the main thread, and children inherit
            its affinity.

    Raises:
        ValueError: ``threads`` below 1 or an unknown ``openmp``.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    openmp = openmp or detect_openmp(environ)
    if openmp not in ("gnu", "intel"):
        raise ValueError(f"openmp must be 'gnu' or 'intel', got {openmp!r}")
    intra = threads or _user_threads(environ) or topology.usable_cores
    wanted = {"OMP_NUM_THREADS": str(intra)}
    if bind and intra == len(topology.allowed_cores()):
        wanted.update(INTEL_BINDING if openmp == "intel" else GNU_BINDING)
    return ThreadPlan(
        intra_op=intra,
        inter_op=INTER_OP_THREADS,
        openmp=openmp,
        env={k: v for k, v in wanted.items() if k not in environ},
        kept={k: environ[k] for k in wanted if k in environ},
    )


def configure_process(
    threads: int | None = None, bind: bool = True, environ: MutableMapping[str, str] = os.environ
) -> ThreadPlan:
    """Plan threads for this process and export the plan's variables into ``environ``.

    Call before torch is imported: OpenMP reads these variables once, when it loads. Variables
    the user set are left as they are. Logs the plan at INFO.
    """
    plan = plan_threads(read_topology(), threads, environ, bind=bind)
    environ.update(plan.env)
    logger.info(plan.describe())
    return plan


def set_torch_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (``plan_threads``' choice) and, while torch still allows it,
    its inter-op threads; returns the intra-op count."""
    import torch

    plan = plan_threads(read_topology(), threads, bind=False)
    if torch.get_num_threads() != plan.intra_op:
        torch.set_num_threads(plan.intra_op)
    if torch.get_num_interop_threads() != plan.inter_op:
        try:
            torch.set_num_interop_threads(plan.inter_op)
        except RuntimeError:  # inter-op work already started; the pool keeps its size
            logger.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    logger.info("torch threads: intra-op %d, inter-op %d", plan.intra_op, torch.get_num_interop_threads())
    return plan.intra_op


def in_fresh_thread(fn: Callable[[], T], name: str = "mineru-fast-build") -> T:
    """``fn()`` run in a new thread that exits when it returns (see the module docstring: the
    OpenMP pool of its parallel ops ends with it). Blocks until then; ``fn``'s exception, if
    any, is raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:  # joined on exit
        return pool.submit(fn).result()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch ops inside run on this thread alone (its OpenMP thread count, a per-thread setting,
    is 1 inside and restored after), so this thread never gets an OpenMP pool of its own (see
    the module docstring). For the light tensor work of threads other than the engine's."""
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)
