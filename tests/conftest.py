"""Shared fixtures: the tiny synthetic model, the optional ../shared data and the side-by-side script."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

# One OpenMP/torch thread for this test process and every process it starts (CLI, serve, bench
# rows), set before anything imports torch (OpenMP reads it once, when it loads). Tests must not
# depend on wall-clock speed and must pass beside another CPU-bound process. On a 2-core machine a
# team of 2 OpenMP threads waits at every barrier for whichever thread is descheduled, which
# multiplies the time of the tiny model's small ops, and that work gains nothing from a second
# thread. (One thread on a larger mask is left unbound by the thread policy, so these processes do
# not all sit on the first core.) A value the user set is kept; tests that need another pass it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The package cache (synthetic models, traces, prepared models) of this test session and the
# processes it starts: a fresh folder, so no test reads what another run left or fills the user's.
os.environ["MINERU_FAST_CACHE"] = tempfile.mkdtemp(prefix="mineru-fast-test-cache-")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MINERU_FAST_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus"
WORKLOAD = SHARED / "workloads" / "omnidocbench_demo"


def need(path: Path) -> Path:
    """Skip the calling test when third-party data is absent (it lives beside the clone)."""
    if not path.exists():
        pytest.skip(f"{path} not present (shared data is used by path, not shipped)")
    return path


@pytest.fixture(scope="session")
def side_by_side():
    """``benchmarks/llamacpp_side_by_side.py`` imported as a module (it is a script, not a package
    module), once per session."""
    spec = importlib.util.spec_from_file_location(
        "llamacpp_side_by_side", REPO / "benchmarks" / "llamacpp_side_by_side.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mineru_fast.engine.synthetic import make_synthetic_model

    return make_synthetic_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def reference_engine(tiny_model: Path):
    from mineru_fast.engine.reference import ReferenceEngine

    return ReferenceEngine(tiny_model, precision="fp32")


@pytest.fixture(scope="session")
def workload_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mineru_fast.protocol.traces import build_omnidocbench_traces

    need(WORKLOAD)
    out = tmp_path_factory.mktemp("traces")
    build_omnidocbench_traces(WORKLOAD / "annotations.json", WORKLOAD / "images", out)
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this session's package cache (see ``MINERU_FAST_CACHE`` above)."""
    import shutil

    shutil.rmtree(os.environ["MINERU_FAST_CACHE"], ignore_errors=True)
