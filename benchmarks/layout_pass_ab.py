"""One layout pass of the median workload page (its 1036x1036 image, replayed: 268 output tokens),
fast preset, on two or more source trees of mineru-fast, alternated, each run in a fresh process.

The acceptance of issue 41 compares the layout pass with the tree the issue was filed on, on the
same machine; this script is that A/B. Each tree must have its kernels built in place
(``python setup.py build_ext --inplace`` with this environment's Python) and is imported through
``PYTHONPATH``; the full-size model is read from ``--model``.

    python benchmarks/layout_pass_ab.py --model DIR --tree OLD_CHECKOUT --tree . [--rounds 2]
        [--workload ../shared/workloads/omnidocbench_demo] [--threads 2] [--json OUT]

Prints one JSON object: each tree's commit, its wall seconds per round (engine built and a crop
request run first, not timed) and the ratio of the medians to the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mineru_fast.bench.report import print_json

CHILD = """
import json, sys, time
from pathlib import Path
import torch
from mineru_fast.bench.fidelity import page_requests
from mineru_fast.bench.workload import load_workload
from mineru_fast.engine.factory import build_engine
from mineru_fast.options import ParserOptions
model, workload, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
options = ParserOptions.preset("fast", threads=threads)
engine = build_engine(Path(model), options)
requests = [r for _, r in page_requests(load_workload(1, Path(workload))[0], options)]
engine.generate(requests[1:2])  # warm-up: one crop
start = time.perf_counter()
(result,) = engine.generate(requests[:1])
print(json.dumps({"wall_s": time.perf_counter() - start, "tokens": len(result.token_ids),
                  "finish_reason": result.finish_reason}))
"""


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return (done.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a source tree (repeat)")
    parser.add_argument("--workload", type=Path, default=Path("../shared/workloads/omnidocbench_demo"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree]
    walls: dict[str, list[float]] = {str(t): [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            env = os.environ | {"PYTHONPATH": str(tree)}
            argv = [sys.executable, "-c", CHILD, str(args.model.resolve()), str(args.workload.resolve()),
                    str(args.threads)]  # fmt: skip
            done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{tree}: {done.stderr.strip().splitlines()[-1:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            if row["finish_reason"] == "error":
                raise SystemExit(f"{tree}: the layout request failed")
            walls[str(tree)].append(row["wall_s"])
            print(f"[layout A/B] {tree.name}: {row['wall_s']:.2f} s, {row['tokens']} tokens", file=sys.stderr)
    first = statistics.median(walls[str(trees[0])])
    result = {
        "threads": args.threads,
        "trees": [
            {"commit": commit(t), "wall_s": walls[str(t)], "ratio_to_first": statistics.median(walls[str(t)]) / first}
            for t in trees
        ],
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
