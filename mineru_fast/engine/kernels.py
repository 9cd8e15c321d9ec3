"""The engine's own compiled kernels: the per-token INT8 linear of decode steps (``csrc/int8_gemv.cpp``)
and the block-wise INT8 linear of the language model (``csrc/int8_block.cpp``).

A decode step multiplies a few rows (one per live sequence) by every language-model weight, so it
is bound by reading the weights once. oneDNN's prepacked INT8 GEMM, built for many rows, took
about 1.5 times the time a weight read takes on one row, plus ~50 us of overhead a call (see
``benchmarks/decode_step.py`` and benchmarks/README.md). The kernel
here streams plain ``[out, in]`` int8 rows through AVX-512 VNNI dot products, 1 to 16 rows of
activations at a time, and quantizes the activations itself; its arithmetic is the oneDNN path's
(``quantize.OneDnnInt8Linear``) operation for operation, so its outputs are bit-identical to it.

It is compiled once per machine with PyTorch's C++ extension builder (a C++ compiler and ninja are
needed; about 30 s), into PyTorch's extension folder (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), in a folder named by the digest of the source and the flags, so a
change of either builds anew and installs of the same code share one build. A process that
finds another one building or loading it (PyTorch's lock file in the build folder) waits for it,
up to ``BUILD_WAIT_S``: processes started together (``launch`` instances, Ray actors) then all run
the kernels, and so the same numerics (the block kernel's differ from its fallback's). It is used
only where the CPU class has AVX-512 VNNI (``cpu.isa_class``, caps included); elsewhere, when the
build fails, or with ``MINERU_FAST_OWN_KERNELS=0``, the engine keeps oneDNN, with the reason
reported by ``int8_gemv_status``.

The block-wise linear (``quantize.BlockInt8Linear``) gives weights and activations one scale per
32 consecutive input values, the granularity of llama.cpp's Q8_0, for any number of rows: it is
the fast preset's language model (benchmarks/README.md, "Numerics on a trained language model").
Both kernels are built together, as one extension.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mineru_fast.runtime.cpu import Topology, isa_class, read_topology

logger = logging.getLogger(__name__)

OWN_KERNELS_ENV = "MINERU_FAST_OWN_KERNELS"
SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("int8_gemv.cpp", "int8_block.cpp"))
# -ffp-contract=off: no multiply-add is fused unless the source says so (std::fma), where the
# PyTorch operator it mirrors fuses it; that is what keeps the outputs bit-identical to oneDNN's path.
# -fopenmp: ATen's parallel_for is inlined here and splits the rows over PyTorch's OpenMP threads
# only when this file is compiled with OpenMP (without it, one thread does all the work).
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
NAME = "mineru_fast_int8_gemv"
STALE_LOCK_S = 600.0  # a build takes ~30 s on 2 busy cores; a lock this old belongs to a killed one
BUILD_WAIT_S = 180.0  # longest wait for another process's build or load: a slow build, not a killed one
LOCK_POLL_S = 0.2
MAX_ROWS = 16  # rows of activations per call (csrc/int8_gemv.cpp's kMaxRows)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the INT8 GEMV kernel is in use here, and why not when it is not.

    Attributes:
        op: the kernel, ``torch.ops.mineru_fast.int8_linear_rows(x [M, K] float32, weight [N, K]
            int8, weight_sum [N] int32, weight_scale [N] float32, bias [N] float32 or None)
            -> [M, N] float32`` for 1 <= M <= ``MAX_ROWS``, or None.
        reason: one line: what runs, or why the kernel does not.
        block_op: the block-wise kernel, ``torch.ops.mineru_fast.int8_block_linear(x [M, K]
            float32, weight [N/16, K/4, 16, 4] uint8, weight_scale [N/16, K/32, 16] float32, bias
            [N] float32 or None, n_size N) -> [M, N] float32`` for any M (layout:
            ``quantize.BlockInt8Linear``), or None (built with ``op``: both or neither).
    """

    op: Callable[..., torch.Tensor] | None
    reason: str
    block_op: Callable[..., torch.Tensor] | None = None


def _build_directory() -> Path:
    """Where this source, built with these flags for this Python and PyTorch, lives: one folder per
    content, so installs of the same code share one build and different code never shares one."""
    from torch.utils.cpp_extension import get_default_build_root

    content = b"".join(source.read_bytes() for source in SOURCES) + repr((CFLAGS, LDFLAGS)).encode()
    digest = hashlib.sha256(content).hexdigest()[:12]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / tag / f"{NAME}-{digest}"


def _source_copies(build: Path) -> list[Path]:
    """The sources, copied into ``build`` (atomically, once): PyTorch's build file names the sources'
    paths, so builds from two checkouts of the same code would otherwise rebuild each other's."""
    build.mkdir(parents=True, exist_ok=True)
    copies = []
    for source in SOURCES:
        copy = build / source.name
        if not copy.exists():
            partial = build / f".{source.name}.{os.getpid()}"
            partial.write_bytes(source.read_bytes())
            partial.replace(copy)
        copies.append(copy)
    return copies


def _held_by_another_build(lock: Path) -> bool:
    """Whether a live build holds ``lock`` (PyTorch's builder waits on it without a bound). A lock
    older than ``STALE_LOCK_S`` was left by a killed build and is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return True
    lock.unlink(missing_ok=True)
    return False


def _another_build_ended(lock: Path, wait_s: float = BUILD_WAIT_S) -> bool:
    """Wait while another live process holds ``lock`` (``_held_by_another_build``), up to
    ``wait_s``; whether it was released (or was stale, or never held) in that time."""
    deadline = time.monotonic() + wait_s
    while _held_by_another_build(lock):
        if time.monotonic() >= deadline:
            return False
        time.sleep(LOCK_POLL_S)
    return True


def _disabled() -> bool:
    return os.environ.get(OWN_KERNELS_ENV, "").strip().lower() in ("0", "off", "false", "no")


def not_planned(topology: Topology | None = None) -> str | None:
    """Why the own kernels are not used on ``topology`` (default: this machine) whatever the build
    (turned off, or a CPU class without AVX-512 VNNI), or None: they are built on first use
    (``int8_gemv_status``), which can still fail. Builds nothing."""
    if _disabled():
        return f"own INT8 GEMV off ({OWN_KERNELS_ENV}=0)"
    cls = isa_class((topology or read_topology()).isa)
    if not cls.vnni:
        return f"own INT8 GEMV needs AVX-512 VNNI; this CPU class is {cls.name}"
    return None


@functools.cache
def int8_gemv_status() -> KernelStatus:
    """Build (first time on this machine) and load the kernels, or say why they are not used.

    Never raises: a missing compiler, a failed build or a CPU without AVX-512 VNNI gives a status
    without an op (logged once).
    """
    reason = not_planned()
    if reason is not None:
        return KernelStatus(None, reason)
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: only here

        build = _build_directory()
        if not _another_build_ended(build / "lock"):
            reason = f"own INT8 GEMV still being built by another process after {BUILD_WAIT_S:.0f} s ({build})"
            logger.warning("%s; oneDNN for now", reason)
            return KernelStatus(None, reason)
        sources = _source_copies(build)
        if not (build / f"{NAME}.so").exists():
            logger.warning("compiling the own INT8 GEMV once for this machine (~30 s) into %s", build)
        load(
            NAME,
            [str(source) for source in sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build),
            is_python_module=False,
        )
        op, block_op = torch.ops.mineru_fast.int8_linear_rows, torch.ops.mineru_fast.int8_block_linear
    except Exception as exc:  # a compiler or ninja missing, a failed build: oneDNN stays
        last = (str(exc).strip().splitlines() or [""])[-1][:200]
        reason = f"own INT8 GEMV not built ({type(exc).__name__}: {last})"
        logger.warning("%s; decode uses oneDNN", reason)
        return KernelStatus(None, reason)
    return KernelStatus(op, f"own AVX-512 VNNI INT8 GEMV for 1-{MAX_ROWS} rows, torch._int_mm above", block_op)
