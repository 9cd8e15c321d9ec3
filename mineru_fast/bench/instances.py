"""A stage row run as several pinned instances (the launcher's CPU groups), measured together.

Each instance is a ``mineru_fast.bench.rows`` process pinned to its group with the launcher's
``spawn``, parsing the whole workload on its group's cores. Instances load and warm up, then
start parsing at the same moment; the row's throughput is all their pages over the slowest one's
wall time, and its latency the per-page seconds of every instance.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from mineru_fast.runtime.cpu import read_topology
from mineru_fast.runtime.launch import plan_groups, spawn


def run_instances(spec: dict, instances: int) -> dict:
    """Run one row's ``spec`` as ``instances`` pinned processes; returns the combined row result.

    Raises:
        RuntimeError: an instance failed (its last stderr line is the message).
        LaunchError: the machine has fewer usable cores than instances.
    """
    topology = read_topology()
    groups = plan_groups(topology, instances)
    procs, logs = [], []
    for group in groups:
        threads = len(topology.allowed_cores(group.cpus))
        argv = [
            sys.executable,
            "-m",
            "mineru_fast.bench.rows",
            json.dumps({**spec, "threads": threads, "barrier": True}),
        ]
        logs.append(tempfile.TemporaryFile("w+"))  # a file, not a pipe: a chatty stderr cannot block
        procs.append(spawn(argv, group, len(topology.nodes), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=logs[-1], text=True))  # fmt: skip
    for proc, log in zip(procs, logs, strict=True):  # each says "ready" after loading and warming up
        assert proc.stdout is not None and proc.stdin is not None  # spawned with pipes
        if proc.stdout.readline().strip() != "ready":
            for p in procs:
                p.kill()
            raise RuntimeError(_last_line(log, proc))
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
    results = []
    for proc, log in zip(procs, logs, strict=True):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(_last_line(log, proc))
        results.append(json.loads(out.strip().splitlines()[-1]))
    per = len(topology.allowed_cores(groups[0].cpus))
    return {
        "label": f"{spec['label']} x {per} core(s)",
        "pages": [name for r in results for name in r["pages"]],
        "page_seconds": [s for r in results for s in r["page_seconds"]],
        "wall_s": max(r["wall_s"] for r in results),
        "timings": {k: sum(r["timings"].get(k, 0.0) for r in results) for k in results[0]["timings"]},
        "load_s": max(r["load_s"] for r in results),
        "warmup_s": max(r["warmup_s"] for r in results),
        "peak_rss_gb": sum(r["peak_rss_gb"] for r in results),  # the instances' memory together
        "markdown": results[0]["markdown"],
        "failures": [f for r in results for f in r["failures"]],
    }


def _last_line(log, proc: subprocess.Popen) -> str:
    """The last stderr line of a failed instance."""
    proc.wait()
    log.seek(0)
    lines = log.read().strip().splitlines()
    return lines[-1] if lines else f"instance exited with status {proc.returncode}"
