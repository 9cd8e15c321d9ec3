"""NUMA-local batch actors: each actor pins itself to ``--cores-per-actor`` cores of one NUMA node.

Ray reserves CPUs by count and pins nothing. On a machine with several NUMA nodes an actor
(``worker.DocumentWorker``) therefore claims a slot on its machine and pins its process to that
slot's cores (``os.sched_setaffinity``) before it loads the model, so its threads, and the memory
they touch first (the weights), stay on one node. One NUMA node: no pinning (the OS schedules).

- ``actor_core_groups``: the machine's groups, slot by slot: node-local groups of ``per`` physical
  cores dealt round-robin over the nodes (slot 0 on node 0, slot 1 on node 1, ...), then groups of
  the cores left over (nodes with fewer than ``per`` cores free), spanning nodes. Built from
  ``cpu``'s topology and core split, as ``launch`` builds its groups.
- ``claim_slot``: the lowest slot no other live actor of this machine holds: an exclusive
  ``flock`` on ``<tmp>/mineru-fast-actor-<per>-<slot>.lock``, released by the kernel when the
  process ends, so an actor Ray restarts takes a free slot again. More actors than groups: slot
  ``n`` takes group ``n % groups`` (cores shared).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

from mineru_fast.runtime.cpu import CoreGroup, Topology, core_group, node_cores, read_topology, whole_chunks

__all__ = ["actor_core_groups", "claim_slot", "pin_process", "pin_actor"]

OVERSUBSCRIPTION = 8  # slots tried per group before an actor gives up pinning (actors per group)


def actor_core_groups(topology: Topology, per: int) -> list[CoreGroup]:
    """The CPU groups of batch actors with ``per`` cores on this machine, slot by slot (see the
    module docstring).

    Args:
        topology: the machine (``cpu.read_topology``).
        per: physical cores per actor (``--cores-per-actor``), >= 1.

    Returns:
        The groups in slot order; empty (no pinning) on one NUMA node or when ``per`` exceeds the
        allowed cores.
    """
    by_node = node_cores(topology)
    if len(by_node) < 2:
        return []
    local = [whole_chunks(cores, per) for cores in by_node]
    dealt = [chunks[i] for i in range(max(map(len, local))) for chunks in local if i < len(chunks)]
    left = [core for cores, chunks in zip(by_node, local, strict=True) for core in cores[len(chunks) * per :]]
    return [core_group(chunk) for chunk in dealt + whole_chunks(left, per)]


def claim_slot(key: str, limit: int, directory: Path | None = None) -> tuple[int, IO[str]] | None:
    """Take the lowest free slot of ``key`` on this machine (an exclusive ``flock`` on its file).

    Args:
        key: what the slots are of (actors of one core count share a key).
        limit: slots tried, ``0 .. limit - 1``.
        directory: where the lock files live (default the system's temporary directory).

    Returns:
        ``(slot, handle)``; the slot is held while ``handle`` stays open (and the process lives).
        None when every slot tried is held or cannot be opened.
    """
    folder = Path(tempfile.gettempdir()) if directory is None else directory
    for slot in range(limit):
        try:
            handle = (folder / f"mineru-fast-{key}-{slot}.lock").open("a")
        except OSError:  # another user's file, a read-only directory: not ours to take
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        return slot, handle
    return None


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process to ``cpus`` (threads started later inherit it).

    Raises:
        OSError: the kernel refused (a CPU outside the process's cgroup).
    """
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def pin_actor(per: int, topology: Topology | None = None) -> tuple[CoreGroup, IO[str]] | None:
    """Claim a slot and pin this process to its group (see the module docstring).

    Args:
        per: the actor's physical cores (``--cores-per-actor``).
        topology: the machine (default: read it).

    Returns:
        ``(group, slot handle)`` (keep the handle open for the actor's life), or None when nothing
        was pinned: one NUMA node, ``per`` over the allowed cores, or no slot free.

    Raises:
        OSError: the kernel refused the affinity.
    """
    groups = actor_core_groups(topology or read_topology(), per)
    claimed = claim_slot(f"actor-{per}", len(groups) * OVERSUBSCRIPTION) if groups else None
    if claimed is None:
        return None
    slot, handle = claimed
    group = groups[slot % len(groups)]
    pin_process(group.cpus)
    return group, handle
