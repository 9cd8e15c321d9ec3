"""Resident memory of one replayed workload page over time, and which code each new high came from.

Loads a parser (the prepared cache as configured), then parses the page with its forced outputs
while a sampling thread reads the process's resident size every ``--interval`` seconds. Each time
the size passes the previous high by ``--step`` MB, the sampler records the innermost
``mineru_fast`` frames of every other thread: where the peak was reached. The kernel's high-water
mark is reset after loading (``/proc/self/clear_refs``), so ``page_hwm_gb`` is the page's exact
peak, which samples can miss by a few MB. Prints one JSON object: ``{"load_s", "after_load_gb",
"peak_gb" (sampled), "page_hwm_gb", "highs": [[s, gb, [frames]], ...], "timeline": [[s, gb], ...],
"markdown_sha1"}``. Memory only: the seconds mean nothing on a busy machine, the sizes do.

``PYTHONPATH=. python benchmarks/page_memory_timeline.py --model <full synthetic> --workload
<shared>/workloads/omnidocbench_demo [--page NAME] [--preset fast] [--threads 2]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
import traceback
from pathlib import Path

from preset_page_speed import DEFAULT_PAGE, replayed_page  # a sibling script (its folder is on sys.path)


def resident_bytes() -> int:
    """This process's resident size now (``/proc/self/statm``), in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def high_water_bytes() -> int:
    """This process's peak resident size (``VmHWM``) since start or the last reset, in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def engine_frames(own: int, depth: int = 4) -> list[str]:
    """The innermost ``depth`` ``mineru_fast`` frames of each thread but ``own``, innermost first."""
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == own:
            continue
        frames = [f for f in traceback.extract_stack(frame) if "mineru_fast" in f.filename]
        if frames:
            names = (f"{f.filename.rpartition('mineru_fast/')[2]}:{f.lineno}:{f.name}" for f in frames[-depth:][::-1])
            found.append(" < ".join(names))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--page", default=DEFAULT_PAGE)
    parser.add_argument("--preset", default="fast")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--step", type=float, default=10.0, help="MB above the last high that records a new one")
    args = parser.parse_args()

    from mineru_fast import DocumentParser, ParserOptions

    image, trace = replayed_page(args.workload, args.page)
    start = time.perf_counter()
    doc_parser = DocumentParser.from_pretrained(args.model, ParserOptions.preset(args.preset, threads=args.threads))
    load_s = time.perf_counter() - start
    after_load = resident_bytes()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the resident size now (Linux 4.0 and later)

    highs: list[tuple[float, float, list[str]]] = []
    timeline: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        high, t0, own = 0, time.perf_counter(), threading.get_ident()
        while not done.is_set():
            now, size = round(time.perf_counter() - t0, 2), resident_bytes()
            timeline.append((now, round(size / 1e9, 3)))
            if size > high + args.step * 1e6:
                high = size
                highs.append((now, round(size / 1e9, 3), engine_frames(own)))
            done.wait(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    doc = doc_parser.parse(image, replay=trace)
    done.set()
    sampler.join()
    every = max(1, len(timeline) // 100)
    print(json.dumps({
        "load_s": round(load_s, 2), "after_load_gb": round(after_load / 1e9, 3),
        "peak_gb": max(gb for _, gb in timeline), "page_hwm_gb": round(high_water_bytes() / 1e9, 3),
        "highs": highs, "timeline": timeline[::every],
        "markdown_sha1": hashlib.sha1(doc.to_markdown().encode()).hexdigest(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
