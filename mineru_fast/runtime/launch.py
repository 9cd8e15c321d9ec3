"""Pinned worker processes: CPU groups for N instances, and a process started on one group.

Each worker is a separate process pinned to its CPUs (``os.sched_setaffinity`` before it starts,
so torch sizes its thread pool to them) and, on a machine with several NUMA nodes and ``numactl``
installed, with its memory bound to its node. ``mineru-fast launch`` (``cli.launch``) and the
benchmark's instance rows (``bench.instances``) start their workers through here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from mineru_fast.errors import MineruFastError
from mineru_fast.runtime.cpu import CoreGroup, Topology, core_group, node_cores, whole_chunks

__all__ = ["LaunchError", "plan_groups", "deal", "spawn"]


class LaunchError(MineruFastError):
    """An instance layout this machine cannot provide (e.g. more instances than cores), or
    arguments that are not a ``parse`` command."""

    code = "bad_launch_request"


def plan_groups(
    topology: Topology, instances: str | int = "auto", cores_per_instance: int | None = None
) -> list[CoreGroup]:
    """CPU groups, one per worker.

    ``instances="auto"``: one group per NUMA node (split into groups of ``cores_per_instance``
    physical cores when given). ``instances=N``: N groups of ``cores_per_instance`` cores (default:
    the usable cores divided evenly), filled node by node so a group stays on one node where it can.
    A group holds every allowed SMT sibling of its cores.

    Raises:
        LaunchError: N < 1, K < 1, or more cores asked for than the process may use.
    """
    if cores_per_instance is not None and cores_per_instance < 1:
        raise LaunchError(f"--cores-per-instance must be >= 1, got {cores_per_instance}")
    by_node = node_cores(topology)
    if instances == "auto":
        if cores_per_instance is None:
            return [core_group(cores) for cores in by_node]
        groups = [core_group(chunk) for cores in by_node for chunk in whole_chunks(cores, cores_per_instance)]
        if not groups:
            raise LaunchError(f"{cores_per_instance} cores per instance exceed every NUMA node's usable cores")
        return groups
    count = int(instances)
    if count < 1:
        raise LaunchError(f"--instances must be 'auto' or >= 1, got {instances}")
    per = cores_per_instance or topology.usable_cores // count
    if per < 1 or count * per > topology.usable_cores:
        raise LaunchError(
            f"{count} instance(s) x {max(per, 1)} core(s) exceed the {topology.usable_cores} usable cores"
        )
    ordered = [core for cores in by_node for core in cores]
    return [core_group(chunk) for chunk in whole_chunks(ordered, per)[:count]]


def deal(inputs: Sequence[str], n: int) -> list[list[str]]:
    """Round-robin split of ``inputs`` into ``n`` lists (``deal("abcde", 2) == [["a","c","e"], ["b","d"]]``)."""
    return [list(inputs[i::n]) for i in range(n)]


def spawn(argv: Sequence[str], group: CoreGroup, numa_nodes: int, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` pinned to ``group.cpus``; memory bound to ``group.node`` with ``numactl`` when
    the machine has several nodes and ``numactl`` is installed. ``popen`` goes to ``Popen``."""
    numactl = shutil.which("numactl")
    if numactl and numa_nodes > 1 and group.node is not None:
        argv = [numactl, f"--membind={group.node}", *argv]
    cpus = set(group.cpus)
    return subprocess.Popen(list(argv), preexec_fn=lambda: os.sched_setaffinity(0, cpus), **popen)  # noqa: PLW1509
