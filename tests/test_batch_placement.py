"""NUMA-local batch actors (``distributed.placement``): the groups actors take on fake machines,
and the slots that spread them (no Ray, nothing pinned in the test process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_machine import build_machine

from mineru_fast.distributed import placement
from mineru_fast.distributed.placement import actor_core_groups, claim_slot, pin_actor
from mineru_fast.runtime.cpu import NumaNode, Topology, read_topology


def machine(*node_sizes: int) -> Topology:
    """One CPU per core (no SMT), NUMA nodes of ``node_sizes`` cores numbered in order."""
    nodes, first = [], 0
    for node, size in enumerate(node_sizes):
        nodes.append(NumaNode(node, tuple(range(first, first + size)), None))
        first += size
    cpus = tuple(range(first))
    return Topology("fake", "fake", {}, tuple((c,) for c in cpus), dict.fromkeys(cpus, 0), tuple(nodes), cpus, None)


def layout(topology: Topology, per: int) -> list[tuple[tuple[int, ...], int | None]]:
    return [(g.cpus, g.node) for g in actor_core_groups(topology, per)]


def test_actors_spread_over_two_numa_nodes_with_their_smt_siblings(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=2, cores_per_socket=4, smt=2)
    two_sockets = read_topology(sysfs, proc, affinity=set(range(16)))
    assert layout(two_sockets, 2) == [
        ((0, 1, 8, 9), 0), ((4, 5, 12, 13), 1), ((2, 3, 10, 11), 0), ((6, 7, 14, 15), 1)
    ]  # fmt: skip
    assert layout(two_sockets, 4) == [((0, 1, 2, 3, 8, 9, 10, 11), 0), ((4, 5, 6, 7, 12, 13, 14, 15), 1)]
    assert layout(two_sockets, 8) == [(tuple(range(16)), None)]  # wider than a node: one group across both
    assert layout(two_sockets, 9) == []  # wider than the machine: not pinned


def test_uneven_nodes_fill_node_local_groups_first_then_span_the_rest():
    assert layout(machine(3, 1), 2) == [((0, 1), 0), ((2, 3), None)]
    assert layout(machine(3, 1), 1) == [((0,), 0), ((3,), 1), ((1,), 0), ((2,), 0)]
    assert layout(machine(5, 2, 3), 2) == [((0, 1), 0), ((5, 6), 1), ((7, 8), 2), ((2, 3), 0), ((4, 9), None)]


def test_one_numa_node_pins_nothing():
    assert layout(machine(8), 2) == []
    assert pin_actor(2, machine(8)) is None


def test_slots_are_taken_lowest_first_and_freed_when_their_holder_closes(tmp_path):
    held = [claim_slot("k", 3, tmp_path) for _ in range(3)]
    assert [slot for slot, _ in held] == [0, 1, 2]
    assert claim_slot("k", 3, tmp_path) is None  # all taken
    assert claim_slot("other", 3, tmp_path) is not None  # another key has its own slots
    held[1][1].close()  # as when an actor's process ends
    again = claim_slot("k", 3, tmp_path)
    assert again is not None and again[0] == 1


def test_more_actors_than_cores_share_groups_round_robin(tmp_path, monkeypatch):
    pinned = []
    monkeypatch.setattr(placement.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(placement, "pin_process", pinned.append)
    two_nodes = machine(1, 1)
    actors = [pin_actor(1, two_nodes) for _ in range(3)]  # three actors, two cores
    assert [(a[0].cpus, a[0].node) for a in actors if a is not None] == [((0,), 0), ((1,), 1), ((0,), 0)]
    assert pinned == [(0,), (1,), (0,)]
    assert len(list(tmp_path.glob("mineru-fast-actor-1-*.lock"))) == 3


@pytest.mark.skipif(not hasattr(placement.os, "sched_setaffinity"), reason="Linux affinity calls")
def test_pin_process_pins_every_thread_of_the_process(monkeypatch):
    calls = []
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda tid, cpus: calls.append((tid, cpus)))
    placement.pin_process((0,))
    tids = {int(t.name) for t in Path("/proc/self/task").iterdir()}
    assert {tid for tid, _ in calls} == tids and all(cpus == (0,) for _, cpus in calls)
