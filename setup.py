"""The compiled part of mineru-fast: the own INT8 kernels (``mineru_fast/engine/csrc``), built when
the package is installed (``pip install .`` or a wheel), so no compiler is needed where the model runs.

Everything else about the package is in pyproject.toml. The extension uses CPython's limited API
(one wheel per platform for every Python from 3.10) and no PyTorch headers (no PyTorch ABI to
match): tensors cross as raw pointers (``mineru_fast/engine/kernels.py``). Every instruction-set path
is compiled into it and the fastest the CPU runs is chosen at run time.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("mineru_fast/engine/csrc")


def source_digest() -> str:
    """SHA-256 of the kernel sources (names and bytes, in name order): the module records it, and a
    development checkout whose sources no longer match says the build is stale (engine.kernels)."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


kernels = Extension(
    "mineru_fast.engine._kernels",
    sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
    depends=sorted(str(p) for p in CSRC.glob("*.h")),
    include_dirs=[str(CSRC)],
    # -ffp-contract=off: no multiply-add is fused unless the source says so (std::fma, the fmadd
    # intrinsics): the arithmetic of every path is then the same, bit for bit. -fopenmp: the work is
    # split over the OpenMP threads of the runtime PyTorch loads (libgomp).
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"],
    extra_link_args=["-fopenmp"],
    define_macros=[("Py_LIMITED_API", "0x030A0000"), ("MINERU_FAST_SOURCE_DIGEST", f'"{source_digest()}"')],
    py_limited_api=True,
)

setup(ext_modules=[kernels], options={"bdist_wheel": {"py_limited_api": "cp310"}})
