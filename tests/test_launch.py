"""The multi-instance launcher: CPU groups, input split, pinned workers, crash reporting."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from fake_machine import build_machine
from samples import sample_trace, text_page

from mineru_fast.cli.launch import EXIT_CRASHED, launch, split_parse_args
from mineru_fast.cli.main import main
from mineru_fast.runtime.cpu import read_topology
from mineru_fast.runtime.launch import LaunchError, deal, plan_groups

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]
HERE = read_topology()
needs_two_cores = pytest.mark.skipif(len(HERE.allowed_cores()) < 2, reason="needs 2 allowed physical cores")


@pytest.fixture
def two_sockets(tmp_path):
    sysfs, proc = build_machine(tmp_path, sockets=2, cores_per_socket=4, smt=2)
    return read_topology(sysfs, proc, affinity=set(range(16)))


def test_auto_is_one_worker_per_numa_node(two_sockets):
    groups = plan_groups(two_sockets)
    assert [(g.cpus, g.node) for g in groups] == [((0, 1, 2, 3, 8, 9, 10, 11), 0), ((4, 5, 6, 7, 12, 13, 14, 15), 1)]


def test_core_groups_stay_within_nodes(two_sockets):
    groups = plan_groups(two_sockets, "auto", cores_per_instance=2)
    assert [(g.cpus, g.node) for g in groups] == [
        ((0, 1, 8, 9), 0), ((2, 3, 10, 11), 0), ((4, 5, 12, 13), 1), ((6, 7, 14, 15), 1)
    ]  # fmt: skip
    assert [g.node for g in plan_groups(two_sockets, 4)] == [0, 0, 1, 1]
    three = plan_groups(two_sockets, 2, cores_per_instance=3)
    assert [(g.cpus, g.node) for g in three] == [((0, 1, 2, 8, 9, 10), 0), ((3, 4, 5, 11, 12, 13), None)]


def test_impossible_layouts_raise(two_sockets):
    with pytest.raises(LaunchError, match="exceed the 8 usable cores"):
        plan_groups(two_sockets, 3, cores_per_instance=3)
    with pytest.raises(LaunchError, match="exceed every NUMA node"):
        plan_groups(two_sockets, "auto", cores_per_instance=5)
    with pytest.raises(LaunchError, match="must be >= 1"):
        plan_groups(two_sockets, 2, cores_per_instance=0)


def test_inputs_are_dealt_round_robin():
    assert deal(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    assert deal(["a"], 3) == [["a"], [], []]


def test_parse_arguments_are_split_into_inputs_and_options():
    inputs, options = split_parse_args(["parse", "a.pdf", "b.png", "--pages", "1-2", "-o", "out"])
    assert inputs == ["a.pdf", "b.png"] and options == ["--pages", "1-2", "-o", "out"]
    with pytest.raises(LaunchError, match="launch runs 'parse'"):
        split_parse_args(["serve"])
    with pytest.raises(LaunchError, match="invalid parse arguments"):
        split_parse_args(["parse", "a.pdf"])  # no -o


@needs_two_cores
def test_workers_are_pinned_and_stream_their_progress():
    out, log = io.StringIO(), []
    status = launch(["parse", "in_a", "in_b", "in_c", "-o", "x"], 2, worker=FAKE_WORKER, out=out, log=log.append)
    cores = HERE.allowed_cores()
    lines = sorted(out.getvalue().splitlines())
    assert status == 0
    assert lines == [
        f"[w0] in_a: success, cpus {list(cores[0])}",
        f"[w0] in_c: success, cpus {list(cores[0])}",
        f"[w1] in_b: success, cpus {list(cores[1])}",
    ]
    assert log[0].startswith("worker 0: cpus ") and log[0].endswith("2 input(s)")


def test_a_crashed_workers_unfinished_inputs_are_reported():
    out, log = io.StringIO(), []
    status = launch(["parse", "in_a", "in_crash", "in_c", "-o", "x"], 1, worker=FAKE_WORKER, out=out, log=log.append)
    assert status == EXIT_CRASHED
    assert out.getvalue().splitlines()[0].startswith("[w0] in_a: success")
    assert log[-1] == "worker 0 crashed (signal 9); not parsed: in_crash in_c"


def test_a_crash_outranks_an_output_error_whichever_worker_ends_first():
    """The status was the last worker's kind: an output error after a crash gave 4, before it 3."""
    for argv in (["in_full", "in_crash"], ["in_crash", "in_full"]):  # dealt one per worker
        status = launch(["parse", *argv, "-o", "x"], 2, worker=FAKE_WORKER, out=io.StringIO(), log=lambda _: None)
        assert status == EXIT_CRASHED, argv


def test_inputs_sharing_an_output_folder_are_refused_before_any_worker_starts():
    """Each worker used to check stem clashes only among its own share, so ``x/a.pdf`` and
    ``y/a.png`` dealt to two workers both wrote ``OUT/a/``."""
    out, log = io.StringIO(), []
    argv = ["parse", "x/a.pdf", "y/a.png", "b.pdf", "z/b.pdf", "-o", "out"]  # dealt: one a and one b per worker
    assert launch(argv, 2, worker=FAKE_WORKER, out=out, log=log.append) == 2
    assert log == [
        "x/a.pdf and y/a.png would both write a/: rename one",
        "b.pdf and z/b.pdf would both write b/: rename one",
    ]
    assert out.getvalue() == ""


@pytest.mark.slow
def test_launch_parses_with_the_tiny_model(tiny_model, tmp_path, capsys):
    (tmp_path / "traces").mkdir()
    for name in ("one", "two"):
        text_page(seed=len(name)).save(tmp_path / f"{name}.png")
        sample_trace(1).save(tmp_path / "traces" / f"{name}.json")
    instances = str(min(2, len(HERE.allowed_cores())))
    argv = ["launch", "--instances", instances, "--", "parse", str(tmp_path / "one.png"), str(tmp_path / "two.png"),
            "-o", str(tmp_path / "out"), "--model", str(tiny_model), "--replay", str(tmp_path / "traces")]  # fmt: skip
    assert main(argv) == 0
    assert (tmp_path / "out" / "one" / "markdown.md").is_file() and (tmp_path / "out" / "two" / "markdown.md").is_file()
    captured = capsys.readouterr()
    assert f"{tmp_path / 'one.png'}: success" in captured.out
    assert "mineru-fast launch: worker 0: cpus" in captured.err
