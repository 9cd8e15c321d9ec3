"""Thread policy: intra-op = usable physical cores, OpenMP variables per runtime, user values kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_machine import build_machine

from mineru_fast.runtime.cpu import read_topology
from mineru_fast.runtime.threads import configure_process, detect_openmp, plan_threads


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
    # `import mineru_fast.cli.main` must not load torch, or OpenMP would read its variables too early.
    code = "import sys, mineru_fast.cli.main; print('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


# The OpenMP pool checks count the process's OS threads (/proc/self/task): GNU OpenMP starts a pool
# of (intra-op threads - 1) workers for each thread that runs a parallel region, kept until that
# thread exits. An elementwise op on 4M floats is far above torch's parallel grain (32768).
POOL_CHECK = """
import os, sys, threading, time
import torch

def count():
    return len(os.listdir("/proc/self/task"))

def settled(expected):
    for _ in range(100):  # a finished thread's pool workers exit right after it
        if count() == expected:
            return expected
        time.sleep(0.05)
    return count()

torch.set_num_threads(2)
"""
needs_gnu_openmp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in __import__("torch").__config__.parallel_info(),
    reason="counts OpenMP pool threads in /proc (Linux, torch built with OpenMP)",
)


def run_pool_check(body: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", POOL_CHECK + body], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@needs_gnu_openmp
def test_one_torch_thread_starts_no_openmp_pool():
    """A thread's op inside ``one_torch_thread`` adds no OS thread; the same op outside adds the
    pool's worker (so the count does see a pool); the thread's own setting comes back."""
    before, inside, outside, restored = run_pool_check("""
from mineru_fast.runtime.threads import one_torch_thread
base = count()
seen = []
def work():
    torch.set_num_threads(2)
    with one_torch_thread():
        torch.ones(4_000_000).add(1.0)
    seen.append(count() - base)  # this thread itself is one
    torch.ones(4_000_000).add(1.0)
    seen.append(count() - base)
    seen.append(torch.get_num_threads())
t = threading.Thread(target=work)
t.start(); t.join()
print(base, *seen)
""")
    assert (inside, outside, restored) == (1, 2, 2), (before, inside, outside, restored)


@needs_gnu_openmp
def test_building_an_engine_leaves_no_openmp_pool_in_the_caller(tiny_model):
    """Loading, quantizing and checking kernels run in a thread that ends with its pool: the
    caller's thread count is back to where it was, and the caller's first op then starts a pool."""
    before, after, after_op = run_pool_check(f"""
from mineru_fast.engine.factory import build_engine
from mineru_fast.options import ParserOptions
base = count()
engine = build_engine({str(tiny_model)!r}, ParserOptions.preset("fast", threads=2))
after = settled(base)
torch.ones(4_000_000).add(1.0)
print(base, after, count())
""")
    assert after == before and after_op == before + 1, (before, after, after_op)
