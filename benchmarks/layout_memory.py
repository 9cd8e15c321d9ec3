"""Peak RSS of one full-size layout pass (1036x1036 page, replayed layout output) per preset.

Each preset runs in a fresh process, so the figure is that process's peak resident set size:
weights, KV buffers, activations and the allocator's slack, from start to the end of the pass.

    python benchmarks/layout_memory.py [--model DIR] [--workload DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from compare_engines import DEFAULT_WORKLOAD, PAGES, synthetic_full_model, trace_dir

PRESETS = ["fast", "bf16", "exact", "reference"]


def one(preset: str, model: Path, workload: Path, threads: int) -> dict:
    from PIL import Image

    from mineru_fast import ParserOptions
    from mineru_fast.engine.base import GenerationRequest
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.memory import peak_rss_bytes
    from mineru_fast.protocol.spec import LAYOUT_TASK, layout_image, prompt_for, sampling_for
    from mineru_fast.protocol.traces import load_trace

    options = ParserOptions.preset(preset, threads=threads)
    engine = build_engine(model, options)
    image = layout_image(Image.open(workload / "images" / PAGES[0]).convert("RGB"))
    layout = load_trace(trace_dir(workload) / (Path(PAGES[0]).stem + ".json")).pages[0].layout
    start = time.perf_counter()
    (result,) = engine.generate([GenerationRequest(image, prompt_for(LAYOUT_TASK), sampling_for(LAYOUT_TASK), layout)])
    assert result.text == layout
    return {
        "preset": preset,
        "seconds": time.perf_counter() - start,
        "tokens": len(result.token_ids),
        "peak_rss_gb": peak_rss_bytes() / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or synthetic_full_model()
    if args.only:
        print(json.dumps(one(args.only, model, args.workload, args.threads)))
        return
    print("| preset | layout pass s | tokens | peak RSS GB |\n|---|---|---|---|")
    for preset in PRESETS:
        cmd = [sys.executable, __file__, "--model", str(model), "--workload", str(args.workload),
               "--threads", str(args.threads), "--only", preset]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"| {r['preset']} | {r['seconds']:.1f} | {r['tokens']} | {r['peak_rss_gb']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
