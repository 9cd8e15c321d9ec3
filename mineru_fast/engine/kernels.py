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
change of either builds anew and installs of the same code share one build. One process at a time
builds or loads it, holding an ``flock`` on ``build.flock`` there (the kernel releases it when its
holder dies, even by SIGKILL, so a killed build never blocks the next start); the build runs in a
private folder and only a finished library is renamed into place, its SHA-256 recorded beside it,
so a killed build leaves nothing half-written that a later start would load, and a library
damaged on disk (or without its record) is built again, never loaded. A process that finds the lock held waits for
it, up to ``BUILD_WAIT_S``: processes started together (``launch`` instances, Ray actors) then all
run the kernels, and so the same numerics (the block kernel's differ from its fallback's). A build
that fails records its reason in ``failed.txt`` beside it, and later starts report that reason
without building again, until the file is removed (or the sources change). The kernels are used
only where the CPU class has AVX-512 VNNI (``cpu.isa_class``, caps included); elsewhere, when the
build fails, or with ``MINERU_FAST_OWN_KERNELS=0``, the engine keeps oneDNN, with the reason
reported by ``int8_gemv_status``.

The block-wise linear (``quantize.BlockInt8Linear``) gives weights and activations one scale per
32 consecutive input values, the granularity of llama.cpp's Q8_0, for any number of rows: it is
the fast preset's language model (benchmarks/README.md, "Numerics on a trained language model").
Both kernels are built together, as one extension.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
BUILD_WAIT_S = 180.0  # longest wait for another process's build or load (a build takes ~30 s on 2 busy cores)
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


@contextmanager
def _build_lock(build: Path, wait_s: float | None = None) -> Iterator[bool]:
    """Hold the exclusive ``flock`` of ``build/build.flock`` while the body runs; yields whether it
    was had within ``wait_s`` (default ``BUILD_WAIT_S``; polled every ``LOCK_POLL_S``). The lock
    dies with its holder."""
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "build.flock", "a+b") as handle:
        deadline = time.monotonic() + (BUILD_WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(LOCK_POLL_S)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _compile(build: Path) -> None:
    """Build and load the extension in a private folder under ``build`` (the sources copied there:
    PyTorch's build file names their paths, so two checkouts of the same code share one build),
    then rename the library into ``build``; what a killed build left is removed first. The caller
    holds the build lock.

    Raises:
        Exception: whatever PyTorch's builder raises (no compiler or ninja, a failed compile).
    """
    from torch.utils.cpp_extension import load  # imports setuptools: only here

    for left in build.glob(".staging-*"):  # a killed build's: no live build holds the lock
        shutil.rmtree(left, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=build))
    try:
        sources = [staging / source.name for source in SOURCES]
        for source, copy in zip(SOURCES, sources, strict=True):
            copy.write_bytes(source.read_bytes())
        load(
            NAME,
            [str(source) for source in sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(staging),
            is_python_module=False,
        )
        (built,) = staging.glob(f"{NAME}*.so")  # PyTorch adds _v1.. to a name built again in one process
        _digest_path(build / f"{NAME}.so").write_text(_sha256(built) + "\n", encoding="utf-8")
        built.replace(build / f"{NAME}.so")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(library: Path) -> bool:
    """Whether the built library's bytes are those whose SHA-256 its build recorded beside it (a
    library without a record, or damaged on disk, is not loaded: it is built again)."""
    try:
        return _digest_path(library).read_text(encoding="utf-8").strip() == _sha256(library)
    except OSError:
        return False


def _build_failure(exc: Exception) -> str:
    """One line on a failed build or load: the error's type and the compiler's first error line
    (PyTorch's message ends with a generic one), else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next((line for line in lines if "error:" in line), lines[-1] if lines else "")
    return f"own INT8 GEMV not built ({type(exc).__name__}: {detail[:200]})"


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
    build = _build_directory()
    failed = build / "failed.txt"
    try:
        with _build_lock(build) as held:
            if not held:
                reason = f"own INT8 GEMV still being built by another process after {BUILD_WAIT_S:.0f} s ({build})"
                logger.warning("%s; oneDNN for now", reason)
                return KernelStatus(None, reason)
            library = build / f"{NAME}.so"
            if library.exists() and not _verified(library):
                logger.warning("%s does not match the digest recorded when it was built; building it again", library)
                library.unlink()
            if library.exists():
                torch.ops.load_library(str(library))
            elif failed.exists():
                reason = f"{failed.read_text(encoding='utf-8').strip()}; remove {failed} to build again"
                logger.warning("%s; decode uses oneDNN", reason)
                return KernelStatus(None, reason)
            else:
                logger.warning("compiling the own INT8 GEMV once for this machine (~30 s) into %s", build)
                try:
                    _compile(build)
                except Exception as exc:
                    failed.write_text(_build_failure(exc) + "\n", encoding="utf-8")
                    raise
        op, block_op = torch.ops.mineru_fast.int8_linear_rows, torch.ops.mineru_fast.int8_block_linear
    except Exception as exc:  # a compiler or ninja missing, a failed build or load: oneDNN stays
        reason = _build_failure(exc)
        logger.warning("%s; decode uses oneDNN", reason)
        return KernelStatus(None, reason)
    return KernelStatus(op, f"own AVX-512 VNNI INT8 GEMV for 1-{MAX_ROWS} rows, torch._int_mm above", block_op)
