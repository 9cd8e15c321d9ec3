"""Cost of one full-size PP-DocLayoutV2 forward (800x800 input) on ONNX Runtime and on torch.

The model is the synthetic full-size one (random weights, the published architecture), written
once by ``make_synthetic_doclayout`` in both forms. Each runtime runs in its own process so its
threads and memory are its own; each row is the median of ``--repeat`` forwards after one
warm-up, on one page (batch 1) and on a window of 4 pages (batch 4, seconds per page), as wall
time and as the process's CPU time (all threads; less sensitive to other work on the machine: on
an idle machine, wall ~ CPU / threads when the threads are kept busy).

    python benchmarks/doclayout_cost.py [--model DIR] [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(backend: str, model: Path, threads: int, repeat: int) -> dict:
    import numpy as np

    from mineru_fast.engine.memory import peak_rss_bytes
    from mineru_fast.layout import LayoutDetector
    from mineru_fast.layout.inference import pixel_values
    from mineru_fast.runtime.threads import set_torch_threads

    set_torch_threads(threads)
    detector = LayoutDetector.from_pretrained(model, backend=backend, threads=threads)
    rng = np.random.default_rng(0)
    from PIL import Image

    pages = [Image.fromarray(rng.integers(0, 256, (2200, 1700, 3), dtype=np.uint8)) for _ in range(4)]
    row = {"backend": backend, "threads": threads}
    for batch in (1, 4):
        pixels, sizes = pixel_values(pages[:batch]), [p.size for p in pages[:batch]]
        detector.runner.run(pixels, sizes)  # warm-up
        times, cpu = [], []
        for _ in range(repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            detector.runner.run(pixels, sizes)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        row[f"batch{batch}_s_per_page"] = statistics.median(times) / batch
        row[f"batch{batch}_cpu_s_per_page"] = statistics.median(cpu) / batch
    start = time.perf_counter()
    pixel_values(pages[:1])
    row["preprocess_s_per_page"] = time.perf_counter() - start
    row["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a synthetic or real PP-DocLayoutV2 folder holding both forms")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from mineru_fast.layout.synthetic import cached_synthetic_doclayout

        args.model = cached_synthetic_doclayout("full")
    if args.only:
        print(json.dumps(one(args.only, args.model, args.threads, args.repeat)))
        return
    print(f"model: {args.model}")
    print("| runtime | threads | batch 1 s/page (CPU s) | batch 4 s/page (CPU s) | preprocess s/page | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for backend in ("onnx", "torch"):
        cmd = [sys.executable, __file__, "--model", str(args.model), "--threads", str(args.threads)]
        out = subprocess.run(
            [*cmd, "--repeat", str(args.repeat), "--only", backend], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {backend} | {r['threads']} | {r['batch1_s_per_page']:.2f} ({r['batch1_cpu_s_per_page']:.2f}) | "
            f"{r['batch4_s_per_page']:.2f} ({r['batch4_cpu_s_per_page']:.2f}) | {r['preprocess_s_per_page']:.3f} | "
            f"{r['peak_rss_gb']:.2f} |"
        )


if __name__ == "__main__":
    main()
