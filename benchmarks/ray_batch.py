"""``mineru-fast batch`` on a local Ray vs ``mineru-fast launch``, same split, side by side in one run.

    python benchmarks/ray_batch.py [--model DIR] [--documents 8] [--pages 2] [-o FILE]

Writes ``--documents`` synthetic PDFs of ``--pages`` pages with replay traces (every run does the
same work whatever the weights), then parses them with 1 and 2 workers of 1 core each: ``launch``
(pinned ``parse`` processes, inputs dealt round-robin) and ``batch`` (a Ray Data actor pool).
Both walls are end to end (workers start, load the model, parse, write); Ray's own start-up is
timed apart. What ``batch`` adds per document: its wall with 1 actor minus ``launch``'s with 1
worker, over the documents (both start one worker, load the model once and parse the same pages;
the manifest's ``wall_s`` is no measure of this, as it counts from the run's inspection of the
document, which comes at the start for every document).
Default model: a tiny synthetic one (made here); ``--model`` takes any model directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from samples import pdf_bytes, sample_trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny synthetic model)")
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--pages", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, help="write the figures as JSON")
    args = ap.parse_args()

    import ray

    from mineru_fast.cli.launch import launch
    from mineru_fast.distributed.batch import BatchConfig, run_batch
    from mineru_fast.engine.synthetic import make_synthetic_model
    from mineru_fast.runtime.cpu import read_topology

    work = Path(tempfile.mkdtemp(prefix="ray-batch-bench-"))
    model = args.model or make_synthetic_model(work / "tiny", size="tiny", seed=0)
    inputs, traces = work / "inputs", work / "traces"
    inputs.mkdir()
    traces.mkdir()
    for i in range(args.documents):
        (inputs / f"doc{i:03d}.pdf").write_bytes(pdf_bytes(args.pages))
        sample_trace(args.pages).save(traces / f"doc{i:03d}.json")
    files = sorted(str(p) for p in inputs.iterdir())
    total_pages = args.documents * args.pages
    workers = [n for n in (1, 2) if n <= len(read_topology().allowed_cores())]

    rows = []
    for n in workers:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            status = launch(["parse", *files, "-o", str(work / f"launch{n}"), "--model", str(model),
                             "--replay", str(traces), "--quiet"], n, 1, log=lambda line: None)  # fmt: skip
        rows.append({"runner": "launch", "workers": n, "wall_s": time.perf_counter() - start, "status": status})

    start = time.perf_counter()
    ray.init(num_cpus=max(workers), include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - start
    for n in workers:
        config = BatchConfig([inputs], work / f"batch{n}", str(model), replay=traces, actors=n, cores_per_actor=1)
        start = time.perf_counter()
        summary = run_batch(config, log=lambda line: None)
        rows.append({"runner": "batch", "workers": n, "wall_s": time.perf_counter() - start,
                     "status": summary.exit_status})  # fmt: skip
    ray.shutdown()

    for row in rows:
        row["pages_per_min"] = 60 * total_pages / row["wall_s"]
    wall = {(r["runner"], r["workers"]): r["wall_s"] for r in rows}
    overhead = (wall[("batch", 1)] - wall[("launch", 1)]) / args.documents
    print(f"{args.documents} documents x {args.pages} pages, model {model}; Ray start-up {ray_start_s:.1f} s\n")
    print("| runner | workers x cores | wall s | pages/min | vs launch |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = wall[("launch", r["workers"])] / r["wall_s"]
        print(f"| {r['runner']} | {r['workers']} x 1 | {r['wall_s']:.1f} | {r['pages_per_min']:.1f} | {ratio:.2f}x |")
    print(f"\nbatch adds {overhead:+.2f} s per document over launch (1 worker each)")
    if args.output:
        figures = {"rows": rows, "ray_start_s": ray_start_s, "overhead_per_document_s": overhead,
                   "documents": args.documents, "pages": args.pages}  # fmt: skip
        args.output.write_text(json.dumps(figures, indent=1))
    return 0 if all(r["status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
