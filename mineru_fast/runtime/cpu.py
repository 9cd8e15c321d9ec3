"""CPU topology the runtime needs: physical cores, SMT siblings, NUMA nodes, allowed CPUs, ISA.

Everything is read from sysfs and procfs under injectable roots, so tests build fake trees:

- ``<sysfs>/devices/system/cpu/online`` and ``cpuN/topology/{physical_package_id,thread_siblings_list}``;
- ``<sysfs>/devices/system/node/nodeN/{cpulist,meminfo}``;
- ``<proc>/cpuinfo`` (model name, ISA flags) and ``<proc>/self/cgroup``;
- the cgroup CPU quota: v2 ``<sysfs>/fs/cgroup/<path>/cpu.max``, v1
  ``<sysfs>/fs/cgroup/cpu,cpuacct/<path>/cpu.cfs_{quota,period}_us`` (every ancestor, the smallest wins).

The process's allowed CPUs are its affinity mask (which a cpuset already narrows); a CPU quota then
caps how many of them can run at once.

Core groups (``CoreGroup``, built with ``node_cores``, ``whole_chunks`` and ``core_group``): the
CPUs one pinned process runs on; ``launch`` splits the machine into them for its workers and the
batch actors for themselves (``distributed.placement``).

ISA class (``isa_class``): the best matrix ISA the kernels may use, from the CPU flags, capped by the
variables that make PyTorch's libraries use less than the CPU has. They take effect only when set
before torch loads (so tests and the benchmark set them for a subprocess: ``simulation_env``):
``ATEN_CPU_CAPABILITY`` (ATen's vectorized kernels), ``ONEDNN_MAX_CPU_ISA`` (oneDNN; also spelled
``DNNL_MAX_CPU_ISA``), ``FBGEMM_ENABLE_INSTRUCTIONS`` (fbgemm) and ``MKL_ENABLE_INSTRUCTIONS``
(MKL). The class is the lowest of the hardware and every cap, so a simulated AVX2 run on an
AVX-512 machine reports, and chooses, as an AVX2 machine would.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

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


# Lowest to highest; the names are the keys of assets/backend_measurements.json ("isa_tier").
ISA_CLASSES = ("baseline", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
_CLASS_FLAG = {"avx2": "avx2", "avx512": "avx512f", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
               "amx": "amx_bf16"}  # fmt: skip

# Each cap variable's values -> the highest class it allows (values not listed: no cap). Sources:
# ATen's CPU capability names, oneDNN's dnnl_cpu_isa names, fbgemm's and MKL's instruction-set names.
_CAPS: dict[str, dict[str, str]] = {
    "ATEN_CPU_CAPABILITY": {"default": "baseline", "avx2": "avx2"},
    "ONEDNN_MAX_CPU_ISA": {
        "sse41": "baseline",
        "avx": "baseline",
        "avx2": "avx2",
        "avx2_vnni": "avx2",
        "avx2_vnni_2": "avx2",
        "avx512_core": "avx512",
        "avx512_core_vnni": "avx512_vnni",
        "avx512_core_bf16": "avx512_bf16",
        "avx512_core_fp16": "avx512_bf16",
        "avx10_1_512": "avx512_bf16",
    },  # fmt: skip
    "FBGEMM_ENABLE_INSTRUCTIONS": {"avx2": "avx2", "avx512": "avx512", "avx512_256": "avx512"},
    "MKL_ENABLE_INSTRUCTIONS": {"sse4_2": "baseline", "avx": "baseline", "avx2": "avx2", "avx512": "avx512"},
}
_CAP_ALIASES = {"DNNL_MAX_CPU_ISA": "ONEDNN_MAX_CPU_ISA"}

# What to set (before torch loads) to run as a CPU of a lower class: every library capped alike.
_SIMULATION: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },  # fmt: skip
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },  # fmt: skip
    "avx512_vnni": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1",
    },  # fmt: skip
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


@dataclass(frozen=True)
class IsaClass:
    """The ISA class kernels run at (see the module docstring).

    Attributes:
        name: one of ``ISA_CLASSES``: the lower of ``hardware`` and every cap.
        hardware: the class of the CPU flags alone.
        capped_by: the cap variables that are set and lower the class, as ``{name: value}``.
        native_bf16: bfloat16 matmuls run in hardware (``avx512_bf16`` or ``amx``); elsewhere
            PyTorch emulates them, several times slower than float32.
        vnni: int8 dot products accumulate in 32 bits in hardware (``avx512_vnni`` and up);
            without it int8 GEMMs sum pairs into saturating 16-bit integers.
    """

    name: str
    hardware: str
    capped_by: dict[str, str]

    @property
    def native_bf16(self) -> bool:
        return ISA_CLASSES.index(self.name) >= ISA_CLASSES.index("avx512_bf16")

    @property
    def vnni(self) -> bool:
        return ISA_CLASSES.index(self.name) >= ISA_CLASSES.index("avx512_vnni")


def isa_class(isa: dict[str, bool], environ: dict[str, str] | None = None) -> IsaClass:
    """The ISA class of CPU ``isa`` flags (``Topology.isa``) under the cap variables of ``environ``
    (default ``os.environ``)."""
    environ = dict(os.environ) if environ is None else environ
    hardware = "baseline"
    for name in ISA_CLASSES[1:]:
        if isa.get(_CLASS_FLAG[name]):
            hardware = name
    rank = ISA_CLASSES.index
    name = hardware
    capped_by: dict[str, str] = {}
    for variable in (*_CAPS, *_CAP_ALIASES):
        value = environ.get(variable)
        cap = _CAPS[_CAP_ALIASES.get(variable, variable)].get((value or "").strip().lower())
        if value is not None and cap is not None and rank(cap) < rank(hardware):
            capped_by[variable] = value
            name = min(name, cap, key=rank)
    return IsaClass(name, hardware, capped_by)


def simulation_env(name: str) -> dict[str, str]:
    """Environment variables that make a process (set before torch loads) use at most ISA class
    ``name`` in ATen, oneDNN, fbgemm and MKL: ``"avx2"``, ``"avx512"``, ``"avx512_vnni"`` or
    ``"avx512_bf16"``.

    Raises:
        ValueError: no recipe for ``name`` (``amx`` is never a cap: it is the top class).
    """
    if name not in _SIMULATION:
        raise ValueError(f"can simulate {sorted(_SIMULATION)}, not {name!r}")
    return dict(_SIMULATION[name])


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, online CPUs and total memory in kB (None where unreadable)."""

    id: int
    cpus: tuple[int, ...]
    memory_kb: int | None


@dataclass(frozen=True)
class Topology:
    """The machine as this process sees it.

    Attributes:
        model: CPU marketing name with its family and model numbers, e.g. ``"AMD EPYC 9B14
            (family 25, model 17)"`` (``"unknown"`` where unreadable).
        vendor: ``vendor_id`` of /proc/cpuinfo, e.g. ``"GenuineIntel"``, ``"AuthenticAMD"``.
        isa: which of ``ISA_FLAGS`` the CPU reports.
        cores: physical cores as tuples of their online logical CPUs (SMT siblings), sorted.
        sockets: physical package id of each online CPU.
        nodes: NUMA nodes with CPUs (one node holding every CPU where sysfs has none).
        allowed: online CPUs in the process's affinity mask.
        quota_cpus: cgroup CPU quota in CPUs (e.g. 3.0), None when unlimited.
    """

    model: str
    vendor: str
    isa: dict[str, bool]
    cores: tuple[tuple[int, ...], ...]
    sockets: dict[int, int]
    nodes: tuple[NumaNode, ...]
    allowed: tuple[int, ...]
    quota_cpus: float | None

    def allowed_cores(self, cpus: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
        """Physical cores with at least one CPU in ``cpus`` (default: the allowed CPUs), each as
        its allowed sibling CPUs."""
        pool = set(self.allowed if cpus is None else cpus)
        out = []
        for core in self.cores:
            mine = tuple(c for c in core if c in pool)
            if mine:
                out.append(mine)
        return out

    @property
    def usable_cores(self) -> int:
        """Physical cores this process can keep busy: allowed cores, capped by the CPU quota (>= 1)."""
        count = len(self.allowed_cores())
        if self.quota_cpus is not None:
            count = min(count, math.floor(self.quota_cpus))
        return max(1, count)

    @property
    def socket_count(self) -> int:
        """Distinct physical packages among the online CPUs."""
        return max(1, len(set(self.sockets.values())))

    def node_of(self, cpu: int) -> int:
        """NUMA node id holding ``cpu`` (0 when no node lists it)."""
        return next((n.id for n in self.nodes if cpu in n.cpus), 0)


@dataclass(frozen=True)
class CoreGroup:
    """The CPUs of some physical cores (each with its allowed SMT siblings), and their NUMA node
    (None when the cores span nodes): what one pinned worker or actor runs on."""

    cpus: tuple[int, ...]
    node: int | None


NodeCore = tuple[int, tuple[int, ...]]
"""A physical core as ``(NUMA node id, its allowed CPUs)``."""


def node_cores(topology: Topology) -> list[list[NodeCore]]:
    """The allowed physical cores of each NUMA node, node by node (nodes without one left out)."""
    by_node = [[(node.id, core) for core in topology.allowed_cores(node.cpus)] for node in topology.nodes]
    return [cores for cores in by_node if cores]


def whole_chunks(cores: list[NodeCore], per: int) -> list[list[NodeCore]]:
    """``cores`` cut into consecutive chunks of exactly ``per`` (a shorter remainder left out)."""
    return [cores[i : i + per] for i in range(0, len(cores) - per + 1, per)]


def core_group(cores: list[NodeCore]) -> CoreGroup:
    """The ``CoreGroup`` of ``cores``: their CPUs sorted, their node if they share one."""
    nodes = {node for node, _ in cores}
    return CoreGroup(tuple(sorted(c for _, core in cores for c in core)), nodes.pop() if len(nodes) == 1 else None)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``; empty text gives ``()``.

    Raises:
        ValueError: malformed list.
    """
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (the kernel's cpulist format)."""
    ranges: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cpuinfo(proc: Path) -> dict[str, str]:
    """The first processor's ``key: value`` fields of /proc/cpuinfo (empty where unreadable)."""
    fields: dict[str, str] = {}
    for line in (_read(proc / "cpuinfo") or "").splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _model_name(info: dict[str, str]) -> str:
    """The CPU's name, with its family and model numbers where /proc/cpuinfo has them: a virtual
    machine's name may leave out the generation (``"AMD EPYC"`` on a Zen 4 and a Zen 5 alike, whose
    bfloat16 and INT8 peaks differ by more than 2x), and figures name the CPU they came from."""
    name = info.get("model name", "unknown")
    if "cpu family" in info and "model" in info:
        return f"{name} (family {info['cpu family']}, model {info['model']})"
    return name


def _online(cpu_dir: Path) -> tuple[int, ...]:
    text = _read(cpu_dir / "online")
    if text is not None:
        return parse_cpulist(text)
    return tuple(range(os.cpu_count() or 1))


def _cores(cpu_dir: Path, online: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], dict[int, int]]:
    cores: set[tuple[int, ...]] = set()
    sockets: dict[int, int] = {}
    for cpu in online:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        siblings = _read(topo / "thread_siblings_list")
        members = parse_cpulist(siblings) if siblings else (cpu,)
        cores.add(tuple(c for c in members if c in online) or (cpu,))
        package = _read(topo / "physical_package_id")
        sockets[cpu] = int(package) if package and package.strip().lstrip("-").isdigit() else 0
    return tuple(sorted(cores)), sockets


def _nodes(node_dir: Path, online: tuple[int, ...]) -> tuple[NumaNode, ...]:
    nodes = []
    for path in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = tuple(c for c in parse_cpulist(_read(path / "cpulist") or "") if c in online)
        if not cpus:
            continue
        match = re.search(r"MemTotal:\s+(\d+)\s*kB", _read(path / "meminfo") or "")
        nodes.append(NumaNode(int(path.name[4:]), cpus, int(match.group(1)) if match else None))
    return tuple(nodes) or (NumaNode(0, online, None),)


def _ancestors(root: Path, relative: str) -> list[Path]:
    """``root/relative`` and each parent up to ``root``; a container often sees only ``root``."""
    parts = [p for p in relative.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_quota_cpus(sysfs: Path = Path("/sys"), proc: Path = Path("/proc")) -> float | None:
    """The cgroup CPU quota of this process in CPUs (``quota / period``), None when unlimited.

    Reads cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` of the process's
    cgroup and its ancestors; the smallest limit wins.
    """
    limits: list[float] = []
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2 unified hierarchy
            for d in _ancestors(sysfs / "fs" / "cgroup", path):
                fields = (_read(d / "cpu.max") or "max").split()
                if len(fields) == 2 and fields[0] != "max":
                    limits.append(int(fields[0]) / int(fields[1]))
        elif "cpu" in controllers.split(","):
            root = sysfs / "fs" / "cgroup" / controllers
            for d in _ancestors(root, path):
                quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def read_topology(sysfs: Path = Path("/sys"), proc: Path = Path("/proc"), affinity: set[int] | None = None) -> Topology:
    """The topology under ``sysfs`` / ``proc`` (the live system by default).

    Args:
        sysfs: root of sysfs (``/sys``).
        proc: root of procfs (``/proc``).
        affinity: the CPUs the process may run on; default ``os.sched_getaffinity(0)`` (every
            online CPU where the platform has no affinity call).

    Returns:
        The ``Topology``; missing files degrade to one node, one socket, one CPU per core.
    """
    cpu_dir = sysfs / "devices" / "system" / "cpu"
    online = _online(cpu_dir)
    if affinity is None:
        affinity = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(online)
    info = _cpuinfo(proc)
    flags = set(info.get("flags", "").split())
    cores, sockets = _cores(cpu_dir, online)
    return Topology(
        model=_model_name(info),
        vendor=info.get("vendor_id", "unknown"),
        isa={flag: flag in flags for flag in ISA_FLAGS},
        cores=cores,
        sockets=sockets,
        nodes=_nodes(sysfs / "devices" / "system" / "node", online),
        allowed=tuple(c for c in online if c in affinity) or online,
        quota_cpus=cgroup_quota_cpus(sysfs, proc),
    )


def physical_cores_available() -> int:
    """Physical cores this process may keep busy (SMT siblings counted once, affinity mask and
    cgroup CPU quota honoured); at least 1."""
    return read_topology().usable_cores
