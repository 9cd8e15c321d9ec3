"""Where the median workload page's time goes, by phase and engine stage: its layout request
alone, then its crops all at once, each split by ``FastEngine.stage_seconds`` (the table
``mineru-fast bench`` prints for its shipped row, here without the rest of the benchmark).

    python benchmarks/page_phases.py --model DIR [--workload ../shared/workloads/omnidocbench_demo]
        [--threads 2] [--reps 1] [--json OUT]

Prints the Markdown table and, with ``--json``, writes every phase of every repetition.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mineru_fast.bench.report import phases_table
from mineru_fast.bench.rows import phase_breakdown, warm_up
from mineru_fast.bench.workload import load_workload
from mineru_fast.options import ParserOptions
from mineru_fast.pipeline.parser import DocumentParser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", type=Path, default=Path("../shared/workloads/omnidocbench_demo"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    doc_parser = DocumentParser.from_pretrained(args.model, ParserOptions.preset("fast", threads=args.threads))
    warm_up(doc_parser)
    if not args.workload.is_dir():
        raise SystemExit(f"no workload folder at {args.workload} (OmniDocBench format: annotations.json, images/)")
    page = load_workload(1, args.workload)[0]
    runs = [phase_breakdown(doc_parser, page) for _ in range(args.reps)]
    for phases in runs:
        print("\n".join(phases_table(phases)), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "page": page.name, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
