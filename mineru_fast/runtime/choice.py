"""ISA-aware choices: the INT8 kernel of ``int8_kernel="auto"`` and the options of the ``auto`` preset.

Both follow the CPU's ISA class (``cpu.isa_class``: the hardware's, or a simulated lower one) and
the figures recorded in ``assets/backend_measurements.json``. An entry there (per CPU vendor and
ISA class, ``isa_tier``) may hold ``candidates_s``: seconds per page of each candidate
configuration below, from ``mineru-fast bench`` on the full-size model, or, before a page was
timed, ``int8_layers_ms``: the summed milliseconds of the INT8 kernels over MinerU2.5's linear
shapes (``benchmarks/int8_kernels.py``). Entries of the same vendor win over another vendor's.

- ``int8_kernel="auto"`` (the ``fast`` preset): the faster recorded per-token kernel (``onednn`` or
  ``int_mm``); ``onednn`` where nothing is recorded. The per-tensor ``torch_ao`` kernel is never
  chosen on speed, only when asked for (``PER_TENSOR_NEVER_AUTO`` says why).
- the ``auto`` preset: the fastest recorded candidate of this class, never bfloat16 where the
  class lacks native bfloat16 (PyTorch would emulate it, several times slower than float32) and
  never per-tensor INT8; without a record, the ``fast`` preset with ``int8_kernel="auto"``.

What an engine built from given options runs (and why) is ``engine.numerics.describe``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from mineru_fast.runtime.cpu import IsaClass, Topology, isa_class, read_topology

logger = logging.getLogger(__name__)

# Recorded per CPU vendor and ISA class; also read by engine.backends (backend="auto").
MEASUREMENTS = Path(__file__).resolve().parents[1] / "assets" / "backend_measurements.json"

PER_TENSOR_NEVER_AUTO = (
    "per-tensor INT8 is never chosen on speed: one activation scale for every row of a call makes a "
    "sequence's numerics depend on what it is batched with, and on a trained Qwen2 LM of MinerU2.5's "
    "shape it agreed with fp32 on far fewer forced steps than per-token INT8 (benchmarks/README.md, "
    "'Numerics on a trained language model')"
)

# Candidate configurations of the auto preset: name -> (preset, overrides).
CANDIDATES: dict[str, tuple[str, dict]] = {
    "int8-onednn": ("fast", {"int8_kernel": "onednn"}),
    "int8-int_mm": ("fast", {"int8_kernel": "int_mm"}),
    "int8-torch_ao": ("fast", {"int8_kernel": "torch_ao"}),
    "bf16": ("bf16", {}),
}
_KERNEL_OF = {"int8-onednn": "onednn", "int8-int_mm": "int_mm", "int8-torch_ao": "torch_ao"}


@dataclass(frozen=True)
class Choice:
    """A resolved choice: ``value`` (a kernel or a candidate name) and why."""

    value: str
    reason: str
    isa: IsaClass
    source: str | None = None  # the measurement entry's ``cpu``, when one decided
    figures: dict = field(default_factory=dict)


def load_measurements(path: Path = MEASUREMENTS) -> list[dict]:
    """The recorded entries of ``MEASUREMENTS`` (each: ``cpu``, ``vendor``, ``isa_tier`` and
    figures); ``[]`` when the file is absent.

    Raises:
        ValueError: the file is not valid JSON.
    """
    if not path.is_file():
        return []
    return json.loads(path.read_text())["entries"]


def _entry(topology: Topology, cls: IsaClass, entries: list[dict], key: str) -> dict | None:
    """This class's entry holding ``key``: the same vendor's first, else any vendor's."""
    matching = [e for e in entries if e.get("isa_tier") == cls.name and e.get(key)]
    return next((e for e in matching if e.get("vendor") == topology.vendor), matching[0] if matching else None)


def _figures(topology: Topology, cls: IsaClass, entries: list[dict]) -> tuple[dict, str, str | None]:
    """``({candidate: seconds}, unit, source cpu)`` recorded for this class: pages if timed, else
    the INT8 kernels' summed milliseconds (candidates named like ``CANDIDATES``)."""
    entry = _entry(topology, cls, entries, "candidates_s")
    if entry:
        return dict(entry["candidates_s"]), "s/page", entry.get("cpu")
    entry = _entry(topology, cls, entries, "int8_layers_ms")
    if entry:
        return {f"int8-{k}": v for k, v in entry["int8_layers_ms"].items()}, "ms of INT8 layers", entry.get("cpu")
    return {}, "", None


def _context(topology: Topology | None, entries: list[dict] | None, environ: dict[str, str] | None):
    topology = topology or read_topology()
    return topology, isa_class(topology.isa, environ), load_measurements() if entries is None else entries


def choose_int8_kernel(
    requested: str = "auto",
    topology: Topology | None = None,
    entries: list[dict] | None = None,
    environ: dict[str, str] | None = None,
) -> Choice:
    """The INT8 kernel for ``ParserOptions.int8_kernel`` (see the module docstring).

    Args:
        requested: ``"auto"`` or a kernel name (returned as is).
        topology: the machine (default: this one).
        entries: measurement entries (default: the shipped file).
        environ: where the ISA cap variables are read (default ``os.environ``).
    """
    topology, cls, entries = _context(topology, entries, environ)
    if requested != "auto":
        return Choice(requested, "requested", cls)
    figures, unit, source = _figures(topology, cls, entries)
    per_token = {k: v for k, v in figures.items() if k in ("int8-onednn", "int8-int_mm")}
    if not per_token:
        return Choice("onednn", f"per-token INT8 on oneDNN: nothing recorded for {cls.name}", cls)
    best = min(per_token, key=per_token.__getitem__)
    shown = {k: round(v, 1) for k, v in figures.items() if k in _KERNEL_OF}
    reason = f"per-token {_KERNEL_OF[best]}: the faster per-token kernel on {source} ({cls.name}), {unit}: {shown}"
    per_tensor = figures.get("int8-torch_ao")
    if per_tensor is not None and per_tensor < per_token[best]:
        reason += f"; {PER_TENSOR_NEVER_AUTO}"
    return Choice(_KERNEL_OF[best], reason, cls, source, shown)


def choose_preset(
    topology: Topology | None = None, entries: list[dict] | None = None, environ: dict[str, str] | None = None
) -> Choice:
    """The candidate (``CANDIDATES`` key) the ``auto`` preset runs (see the module docstring)."""
    topology, cls, entries = _context(topology, entries, environ)
    figures, unit, source = _figures(topology, cls, entries)
    allowed = {
        k: v
        for k, v in figures.items()
        if k in CANDIDATES and k != "int8-torch_ao" and (k != "bf16" or cls.native_bf16)
    }  # per-tensor INT8: PER_TENSOR_NEVER_AUTO
    if not allowed:
        kernel = choose_int8_kernel("auto", topology, entries, environ)
        return Choice(f"int8-{kernel.value}", f"nothing recorded for {cls.name}: fast preset; {kernel.reason}", cls)
    best = min(allowed, key=allowed.__getitem__)
    shown = {k: round(v, 1) for k, v in allowed.items()}
    skipped = " (bf16 left out: emulated on this class)" if "bf16" in figures and "bf16" not in allowed else ""
    return Choice(best, f"fastest recorded on {source} ({cls.name}), {unit}: {shown}{skipped}", cls, source, shown)
