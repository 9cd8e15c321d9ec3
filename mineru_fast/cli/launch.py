"""``mineru-fast launch``: several pinned ``parse`` workers, one per NUMA node or core group.

Each worker is a separate process pinned to its CPUs (``os.sched_setaffinity`` before it starts,
so torch sizes its thread pool to them) and, on a machine with several NUMA nodes and ``numactl``
installed, with its memory bound to its node. Inputs are dealt round-robin; every worker line is
streamed with a ``[wN]`` prefix. Exit status: the worst of the workers' (0 ok, 1 pages failed,
2 input or usage error, 4 output error), or ``EXIT_CRASHED`` when a worker died (signal or other status), in which
case the inputs it had not finished are listed. Inputs that would write the same ``OUT/<stem>/``
are refused before any worker starts (``EXIT_USAGE``, one line per clash), as ``parse`` does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from mineru_fast.cli.options import add_parse_arguments
from mineru_fast.inputs.paths import clash_message, expand_inputs, output_clashes
from mineru_fast.runtime.cpu import CoreGroup, Topology, format_cpulist, read_topology
from mineru_fast.runtime.launch import LaunchError, deal, plan_groups, spawn

EXIT_USAGE, EXIT_CRASHED, EXIT_OUTPUT = 2, 3, 4  # 2 and 4 as parse's
WORKER = (sys.executable, "-m", "mineru_fast")


@dataclass
class Worker:
    """A started worker and what it was given."""

    index: int
    group: CoreGroup
    inputs: list[str]
    process: subprocess.Popen
    done: set[str] = field(default_factory=set)
    streams: list[threading.Thread] = field(default_factory=list)


def _stream(worker: Worker, pipe: TextIO, out: TextIO, lock: threading.Lock, prefix: str) -> None:
    """Copy a worker's lines to ``out`` with its tag; note inputs it reports as handled."""
    for line in pipe:
        for source in worker.inputs:
            if line.startswith(f"{source}: ") or line.startswith(f"mineru-fast: {source}: "):
                worker.done.add(source)
        with lock:
            out.write(f"[w{worker.index}]{prefix} {line}")
            out.flush()


def split_parse_args(parse_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``["parse", "a.pdf", "-o", "out", "b.png"]`` -> (input files, the other arguments); a
    directory among the inputs is replaced by its files (``inputs.paths.expand_inputs``).

    Raises:
        LaunchError: the command is not ``parse ...`` or names no input.
    """
    if not parse_args or parse_args[0] != "parse":
        raise LaunchError("launch runs 'parse': mineru-fast launch [--instances N] -- parse INPUT... -o OUT")
    parser = argparse.ArgumentParser(prog="mineru-fast parse")
    add_parse_arguments(parser)
    try:
        args = parser.parse_args(list(parse_args[1:]))
    except SystemExit as exc:
        raise LaunchError(f"invalid parse arguments: {' '.join(parse_args[1:])}") from exc
    given = [str(p) for p in args.inputs]
    rest = list(parse_args[1:])
    # argparse took the inputs as one run of consecutive arguments: remove exactly that run.
    start = next(i for i in range(len(rest)) if rest[i : i + len(given)] == given)
    # directories become their files here, so they are dealt to the workers file by file
    return [str(p) for p in expand_inputs(args.inputs)], rest[:start] + rest[start + len(given) :]


def launch(
    parse_args: Sequence[str],
    instances: str | int = "auto",
    cores_per_instance: int | None = None,
    topology: Topology | None = None,
    worker: Sequence[str] = WORKER,
    out: TextIO | None = None,
    log: Callable[[str], None] = lambda line: print(f"mineru-fast launch: {line}", file=sys.stderr),
) -> int:
    """Run ``parse`` over the inputs of ``parse_args`` in pinned workers; returns the exit status.

    Args:
        parse_args: ``["parse", INPUT..., options...]`` as given to ``mineru-fast``.
        instances / cores_per_instance: see ``plan_groups``; never more workers than inputs.
        topology: the machine (default: read it).
        worker: the command a worker runs before its arguments (default this package's CLI).
        out: where workers' lines are streamed (default ``sys.stdout``).
        log: receives the launcher's own messages (plan, output clashes, crashes, unparsed inputs).

    Raises:
        LaunchError: bad instance layout or ``parse`` arguments.
    """
    topology = topology or read_topology()
    out = out or sys.stdout
    inputs, options = split_parse_args(parse_args)
    if clashes := output_clashes([Path(source) for source in inputs]):  # each worker sees only its share
        for first, second in clashes:
            log(clash_message(first, second))
        return EXIT_USAGE
    groups = plan_groups(topology, instances, cores_per_instance)[: len(inputs)]
    lock = threading.Lock()
    workers = []
    for i, (group, share) in enumerate(zip(groups, deal(inputs, len(groups)), strict=True)):
        log(f"worker {i}: cpus {format_cpulist(group.cpus)}, node {group.node}, {len(share)} input(s)")
        proc = spawn([*worker, "parse", *options, *share], group, len(topology.nodes),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        w = Worker(i, group, share, proc)
        workers.append(w)
        for pipe, prefix in ((proc.stdout, ""), (proc.stderr, "!")):
            w.streams.append(threading.Thread(target=_stream, args=(w, pipe, out, lock, prefix), daemon=True))
            w.streams[-1].start()
    status = 0
    for w in workers:
        code = w.process.wait()
        if code in (0, 1, 2, EXIT_OUTPUT):
            status = status if status == EXIT_CRASHED else max(status, code)
            continue
        status = EXIT_CRASHED  # ranks above every other outcome: inputs were left unparsed
        for t in w.streams:  # its last lines tell which inputs it finished
            t.join()
        lost = [s for s in w.inputs if s not in w.done]
        reason = f"signal {-code}" if code < 0 else f"status {code}"
        log(f"worker {w.index} crashed ({reason}); not parsed: {' '.join(lost) or 'none'}")
    for w in workers:
        for t in w.streams:
            t.join()
    return status
