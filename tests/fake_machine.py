"""Fake sysfs/procfs trees for topology tests: build a machine's files under a temporary root."""

from __future__ import annotations

from pathlib import Path

from mineru_fast.runtime.cpu import format_cpulist

ZEN4_FLAGS = "fpu sse2 avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
SPR_FLAGS = ZEN4_FLAGS + " amx_tile amx_bf16 amx_int8"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build_machine(
    root: Path,
    sockets: int,
    cores_per_socket: int,
    smt: int = 1,
    flags: str = ZEN4_FLAGS,
    vendor: str = "AuthenticAMD",
    cgroup: str = "0::/\n",
    cgroup_files: dict[str, str] | None = None,
) -> tuple[Path, Path]:
    """Write sysfs and procfs for ``sockets`` x ``cores_per_socket`` cores with ``smt`` threads each.

    CPUs are numbered Linux-style: first thread of every core, then the second threads
    (core k of the machine is CPUs ``k`` and ``k + cores``). One NUMA node per socket, 16 GB each.

    Returns:
        ``(sysfs, proc)`` roots to pass to ``read_topology``.
    """
    sysfs, proc = root / "sys", root / "proc"
    cores = sockets * cores_per_socket
    cpus = cores * smt
    cpu_dir = sysfs / "devices" / "system" / "cpu"
    _write(cpu_dir / "online", f"0-{cpus - 1}\n")
    for cpu in range(cpus):
        core = cpu % cores
        siblings = [core + t * cores for t in range(smt)]
        _write(cpu_dir / f"cpu{cpu}" / "topology" / "thread_siblings_list", format_cpulist(siblings) + "\n")
        _write(cpu_dir / f"cpu{cpu}" / "topology" / "physical_package_id", f"{core // cores_per_socket}\n")
    for node in range(sockets):
        node_cpus = [c for c in range(cpus) if (c % cores) // cores_per_socket == node]
        node_dir = sysfs / "devices" / "system" / "node" / f"node{node}"
        _write(node_dir / "cpulist", format_cpulist(node_cpus) + "\n")
        _write(node_dir / "meminfo", f"Node {node} MemTotal:       16000000 kB\nNode {node} MemFree: 1 kB\n")
    _write(proc / "cpuinfo", f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: Fake CPU\nflags\t\t: {flags}\n\n")
    _write(proc / "self" / "cgroup", cgroup)
    for relative, text in (cgroup_files or {}).items():
        _write(sysfs / "fs" / "cgroup" / relative, text)
    return sysfs, proc
