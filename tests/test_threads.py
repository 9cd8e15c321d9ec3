"""Thread policy: intra-op = usable physical cores, OpenMP variables per runtime, user values kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_machine import build_machine

from mineru_fast.cpu import read_topology
from mineru_fast.threads import configure_process, detect_openmp, plan_threads


@pytest.fixture
def two_sockets(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=2, cores_per_socket=4, smt=2)
    return read_topology(sysfs, proc, affinity=set(range(16)))


def test_one_thread_per_physical_core_with_gnu_binding(two_sockets):
    plan = plan_threads(two_sockets, environ={}, openmp="gnu")
    assert (plan.intra_op, plan.inter_op) == (8, 1)
    assert plan.env == {"OMP_NUM_THREADS": "8", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    assert plan.kept == {}


def test_intel_openmp_gets_kmp_variables(two_sockets):
    plan = plan_threads(two_sockets, environ={}, openmp="intel")
    assert plan.env == {"OMP_NUM_THREADS": "8", "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


def test_user_values_are_kept_and_reported(two_sockets):
    environ = {"OMP_NUM_THREADS": "8", "OMP_PROC_BIND": "spread"}
    plan = plan_threads(two_sockets, environ=environ, openmp="gnu")
    assert plan.intra_op == 8
    assert plan.env == {"OMP_PLACES": "cores"} and plan.kept == environ
    assert "kept user-set OMP_NUM_THREADS=8 OMP_PROC_BIND=spread" in plan.describe()


@pytest.mark.parametrize("threads", [1, 7])
def test_fewer_threads_than_allowed_cores_are_not_bound(two_sockets, threads):
    """Bound, 1 thread of each of two processes would sit on the mask's first core, both."""
    plan = plan_threads(two_sockets, threads=threads, environ={}, openmp="gnu")
    assert plan.env == {"OMP_NUM_THREADS": str(threads)}


def test_a_cpu_quota_below_the_mask_is_not_bound(tmp_path):
    sysfs, proc = build_machine(tmp_path, 1, 8, smt=2, cgroup="0::/\n", cgroup_files={"cpu.max": "300000 100000"})
    plan = plan_threads(read_topology(sysfs, proc, affinity=set(range(16))), environ={}, openmp="gnu")
    assert plan.env == {"OMP_NUM_THREADS": "3"}
    narrowed = read_topology(sysfs, proc, affinity={0, 1, 2})  # launch's per-worker mask: bound
    assert plan_threads(narrowed, environ={}, openmp="gnu").env["OMP_PROC_BIND"] == "close"


def test_explicit_threads_win_but_do_not_rewrite_the_user_variable(two_sockets):
    plan = plan_threads(two_sockets, threads=5, environ={"OMP_NUM_THREADS": "3"}, openmp="gnu", bind=False)
    assert plan.intra_op == 5 and plan.env == {} and plan.kept == {"OMP_NUM_THREADS": "3"}


def test_quota_limited_container_gets_its_quota(tmp_path):
    sysfs, proc = build_machine(tmp_path, 1, 8, smt=2, cgroup="0::/\n", cgroup_files={"cpu.max": "300000 100000"})
    plan = plan_threads(read_topology(sysfs, proc, affinity=set(range(16))), environ={"OMP_NUM_THREADS": "x"})
    assert plan.intra_op == 3  # a malformed user value is kept in the environment, not used


def test_invalid_arguments_raise(two_sockets):
    with pytest.raises(ValueError, match="threads"):
        plan_threads(two_sockets, threads=0, environ={})
    with pytest.raises(ValueError, match="openmp"):
        plan_threads(two_sockets, environ={}, openmp="llvm")


def test_openmp_detection(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00 r-xp /usr/lib/libgomp.so.1\n")
    assert detect_openmp({}, maps) == "gnu"
    assert detect_openmp({"LD_PRELOAD": "/opt/lib/libiomp5.so"}, maps) == "intel"
    maps.write_text("7f00 r-xp /opt/lib/libiomp5.so\n")
    assert detect_openmp({}, maps) == "intel"


def test_configure_process_exports_only_missing_variables():
    environ = {"OMP_PLACES": "threads"}
    plan = configure_process(threads=2, environ=environ)
    assert environ["OMP_NUM_THREADS"] == "2" and environ["OMP_PLACES"] == "threads"
    assert plan.kept == {"OMP_PLACES": "threads"}


def test_importing_the_cli_does_not_load_torch():
    # `import mineru_fast.cli` must not load torch, or OpenMP would read its variables too early.
    code = "import sys, mineru_fast.cli; print('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
