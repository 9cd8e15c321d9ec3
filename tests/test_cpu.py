"""CPU topology read from fake sysfs/procfs trees: one socket, two sockets with SMT, a container."""

from __future__ import annotations

import pytest
from fake_machine import SPR_FLAGS, build_machine

from mineru_fast.runtime.cpu import cgroup_quota_cpus, format_cpulist, parse_cpulist, read_topology


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    assert format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        parse_cpulist("0-x")


def test_one_socket_without_smt(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=1, cores_per_socket=4)
    topo = read_topology(sysfs, proc, affinity={0, 1, 2, 3})
    assert topo.cores == ((0,), (1,), (2,), (3,))
    assert topo.usable_cores == 4 and topo.socket_count == 1
    assert [(n.id, n.cpus, n.memory_kb) for n in topo.nodes] == [(0, (0, 1, 2, 3), 16000000)]
    assert topo.isa["avx512_bf16"] and topo.isa["avx512_vnni"] and not topo.isa["amx_tile"]
    assert (topo.model, topo.vendor, topo.quota_cpus) == ("Fake CPU", "AuthenticAMD", None)


def test_the_model_name_carries_the_family_and_model_numbers(tmp_path):
    """A virtual machine's CPU name may leave out the generation ("AMD EPYC" for Zen 4 and Zen 5
    alike): the family and model numbers are added where /proc/cpuinfo has them."""
    sysfs, proc = build_machine(tmp_path, sockets=1, cores_per_socket=2)
    fields = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
    (proc / "cpuinfo").write_text(fields + "flags\t\t: avx2\n\nprocessor\t: 1\nmodel\t\t: 9\n")
    assert read_topology(sysfs, proc, affinity={0, 1}).model == "AMD EPYC (family 26, model 2)"


def test_two_sockets_with_smt(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=2, cores_per_socket=4, smt=2, flags=SPR_FLAGS, vendor="GenuineIntel")
    topo = read_topology(sysfs, proc, affinity=set(range(16)))
    assert len(topo.cores) == 8 and topo.cores[0] == (0, 8) and topo.cores[7] == (7, 15)
    assert topo.usable_cores == 8 and topo.socket_count == 2
    assert [n.cpus for n in topo.nodes] == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert topo.node_of(13) == 1 and topo.node_of(2) == 0
    assert topo.isa["amx_bf16"] and topo.isa["amx_int8"]
    # Pinned to one thread of each core of node 1 plus a sibling: 4 physical cores.
    pinned = read_topology(sysfs, proc, affinity={4, 5, 6, 7, 12})
    assert pinned.allowed_cores() == [(4, 12), (5,), (6,), (7,)] and pinned.usable_cores == 4


def test_container_limited_by_affinity(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=1, cores_per_socket=8, smt=2)
    topo = read_topology(sysfs, proc, affinity={0, 1, 2})
    assert topo.allowed == (0, 1, 2) and topo.usable_cores == 3


def test_container_limited_by_cgroup_v2_quota(tmp_path):
    sysfs, proc = build_machine(
        tmp_path, 1, 8, smt=2, cgroup="0::/kubepods/pod1\n",
        cgroup_files={"kubepods/pod1/cpu.max": "300000 100000\n", "kubepods/cpu.max": "max 100000\n"},
    )  # fmt: skip
    topo = read_topology(sysfs, proc, affinity=set(range(16)))
    assert topo.quota_cpus == 3.0 and len(topo.allowed) == 16 and topo.usable_cores == 3


def test_container_limited_by_cgroup_v1_quota(tmp_path):
    sysfs, proc = build_machine(
        tmp_path, 1, 8, cgroup="4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
        cgroup_files={"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
                      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                      "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    assert cgroup_quota_cpus(sysfs, proc) == 2.5
    assert read_topology(sysfs, proc, affinity=set(range(8))).usable_cores == 2


def test_container_sees_its_cgroup_at_the_root(tmp_path):
    # In a cgroup namespace the path in /proc/self/cgroup may not exist below the mount: the root counts.
    sysfs, proc = build_machine(tmp_path, 1, 4, cgroup="0::/not/mounted\n", cgroup_files={"cpu.max": "100000 100000"})
    assert cgroup_quota_cpus(sysfs, proc) == 1.0


def test_missing_sysfs_degrades_to_one_node(tmp_path):
    topo = read_topology(tmp_path / "nosys", tmp_path / "noproc", affinity={0})
    assert topo.usable_cores == 1 and len(topo.nodes) == 1 and topo.model == "unknown"
    assert not any(topo.isa.values())


def test_this_machine_has_a_consistent_topology():
    topo = read_topology()
    assert 1 <= topo.usable_cores <= len(topo.allowed)
    assert set(topo.allowed) <= {c for n in topo.nodes for c in n.cpus}
