"""Seconds per replayed workload page for presets (and environment variants), side by side.

Each variant runs in a fresh process (so an environment variable such as ``MALLOC_MMAP_THRESHOLD_``
takes effect from the start): it loads the parser (warm prepared cache), then parses the same page
``--parses`` times with its forced outputs (replay: the real model's cost with random weights) and
prints one JSON line ``{"variant", "preset", "env", "load_s", "walls_s", "blocks", "markdown_sha1"}``.
The variants alternate, ``--rounds`` times, so a drift of the machine reaches them all alike.

``PYTHONPATH=. python benchmarks/preset_page_speed.py --model <full synthetic> --workload
<shared>/workloads/omnidocbench_demo [--page NAME] [--threads 2] [--rounds 2] [--parses 2]
[--variant fast] [--variant bf16] [--variant fast:MALLOC_MMAP_THRESHOLD_=33554432]
[--variant fast+lm_quant=int8-dynamic+lm_head_quant=int8-dynamic]``

A variant is ``PRESET[+FIELD=VALUE...][:VAR=VALUE[,VAR=VALUE]]``: a preset, ``ParserOptions``
fields it overrides (strings) and environment variables. Run it on a quiet machine: only ratios
within one run mean anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PAGE = "notes_f7f010b78016aeebd76e56d9283eb67f_49"  # 17 blocks, the workload's median page


def replayed_page(workload: Path, page: str):
    """``(image, trace)`` of workload page ``page``: its RGB image and the forced outputs built
    from its ground truth (``protocol.traces.build_omnidocbench_traces``)."""
    from PIL import Image

    from mineru_fast.protocol.traces import build_omnidocbench_traces, load_trace

    traces = Path(tempfile.mkdtemp())
    build_omnidocbench_traces(workload / "annotations.json", workload / "images", traces)
    image = Image.open(workload / "images" / f"{page}.jpg").convert("RGB")
    return image, load_trace(traces / f"{page}.json")


def child(args: argparse.Namespace) -> None:
    """One variant in this process: load, parse ``args.parses`` times, print the JSON line."""
    from mineru_fast import DocumentParser, ParserOptions

    image, trace = replayed_page(args.workload, args.page)
    start = time.perf_counter()
    preset, *fields = args.preset.split("+")
    overrides = dict(field.split("=", 1) for field in fields)
    parser = DocumentParser.from_pretrained(args.model, ParserOptions.preset(preset, threads=args.threads, **overrides))
    load_s = time.perf_counter() - start
    walls, markdown, doc = [], None, None
    for _ in range(args.parses):
        start = time.perf_counter()
        doc = parser.parse(image, replay=trace)
        walls.append(round(time.perf_counter() - start, 2))
        markdown = markdown or doc.to_markdown()
    print(json.dumps({"preset": args.preset, "load_s": round(load_s, 2), "walls_s": walls,
                      "blocks": len(doc.pages[0].blocks),
                      "markdown_sha1": hashlib.sha1(markdown.encode()).hexdigest()}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--page", default=DEFAULT_PAGE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parses", type=int, default=2)
    parser.add_argument("--variant", action="append", help="PRESET[+FIELD=VALUE...][:VAR=VALUE,...] (repeatable)")
    parser.add_argument("--preset", help=argparse.SUPPRESS)  # set in the child process
    args = parser.parse_args()
    if args.preset:
        child(args)
        return
    variants = args.variant or ["fast", "bf16"]
    common = ["--model", str(args.model), "--workload", str(args.workload), "--page", args.page,
              "--threads", str(args.threads), "--parses", str(args.parses)]  # fmt: skip
    for _ in range(args.rounds):
        for variant in variants:
            preset, _, assignments = variant.partition(":")
            extra = dict(kv.split("=", 1) for kv in assignments.split(",") if kv)
            proc = subprocess.run([sys.executable, __file__, *common, "--preset", preset], env={**os.environ, **extra},
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                print(json.dumps({"variant": variant, "error": proc.stderr.strip().splitlines()[-1:]}), flush=True)
                continue
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps({"variant": variant, "env": extra, **result}), flush=True)


if __name__ == "__main__":
    main()
