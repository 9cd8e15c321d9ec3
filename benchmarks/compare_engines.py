"""Side-by-side: reference engine (bf16, batch 1) vs the fast engine's presets on replayed pages.

Each configuration runs in its own process (clean peak RSS), parses the same workload pages with
their traces replayed (forced decoding: the cost of the real model producing that output), and
reports pages/min, the vision / prefill / decode split and peak RSS; the Markdown of every
configuration must equal the first one's. Then it measures decode steps at batch 1 and 16 and
(unless ``--skip-vision-modes``) the vision encoder in eager, TorchScript and torch.compile modes
on the layout image.

    python benchmarks/compare_engines.py [--model DIR] [--workload DIR] [--threads 2] [--out results.json]
                                         [--skip-vision-modes]

Without ``--model`` the ``full`` synthetic model is made (once) in the package cache
(``$MINERU_FAST_CACHE``, default ``~/.cache/mineru-fast``), where the workload's traces are built too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "omnidocbench_demo"
# The median page of the demo set (396 layout tokens, 16 crops, 683 content tokens), the densest
# (38 blocks, 2476 tokens) and a table-heavy Chinese page.
PAGES = [
    "jiaocaineedrop_Chapter9.pdf_46.jpg",
    "docstructbench_llm-raw-scihub-o.O-j.physletb.2004.06.101.pdf_3.jpg",
    "docstructbench_dianzishu_zhongwenzaixian-o.O-61520814.pdf_185.jpg",
]
CONFIGS = ["reference", "fast"]


def trace_dir(workload: Path) -> Path:
    """Where the workload's replay traces are built (the workload folder may be read-only)."""
    from mineru_fast.runtime.hub import cache_dir

    return cache_dir() / "traces" / workload.name


def run_config(preset: str, model: Path, workload: Path, threads: int) -> dict:
    """Parse the pages with one preset (in this process) and return its measurements."""
    from PIL import Image

    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.engine.memory import peak_rss_bytes
    from mineru_fast.protocol.traces import Trace, load_trace

    start = time.perf_counter()
    parser = DocumentParser.from_pretrained(model, ParserOptions.preset(preset, threads=threads))
    load_s = time.perf_counter() - start
    images = [Image.open(workload / "images" / name).convert("RGB") for name in PAGES]
    traces = [load_trace(trace_dir(workload) / (Path(name).stem + ".json")).pages[0] for name in PAGES]
    start = time.perf_counter()
    document = parser.parse(images, replay=Trace(traces))
    wall = time.perf_counter() - start
    assert document.status == "success", [p.errors for p in document.pages]
    return {
        "preset": preset,
        "load_s": load_s,
        "wall_s": wall,
        "pages": len(images),
        "pages_per_min": 60 * len(images) / wall,
        "timings": document.timings,
        "tokens": document.timings.get("tokens", 0),
        "peak_rss_gb": peak_rss_bytes() / 1e9,
        "markdown": document.to_markdown(),
    }


def decode_steps(model: Path, threads: int) -> dict:
    """Milliseconds per decode step of the fast preset's LM at batch 1 and 16 (1500-token context)."""
    import torch

    from mineru_fast import ParserOptions
    from mineru_fast.engine.factory import build_engine

    engine = build_engine(model, ParserOptions.preset("fast", threads=threads))
    out = {}
    with torch.inference_mode():
        for batch in (1, 16):
            tokens, position = torch.randint(0, 150000, (batch,)), torch.full((batch,), 1500)
            engine.lm.decode(tokens, position, position)
            start = time.perf_counter()
            for step in range(10):
                engine.lm.decode(tokens, position + step, position + step)
            out[f"batch{batch}_ms_per_step"] = (time.perf_counter() - start) / 10 * 1000
            out[f"batch{batch}_tokens_per_s"] = batch * 1000 / out[f"batch{batch}_ms_per_step"]
    return out


def vision_mode(model: Path, workload: Path, threads: int, mode: str) -> dict:
    """Seconds of the fast preset's vision encoder on one layout image in ``mode`` (the first call
    includes tracing/compilation; the second is the steady state) and the process's peak RSS."""
    import torch
    from PIL import Image

    from mineru_fast import ParserOptions
    from mineru_fast.engine.base import GenerationRequest
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.memory import peak_rss_bytes
    from mineru_fast.engine.vision_runner import make_vision_runner
    from mineru_fast.protocol.spec import LAYOUT_TASK, layout_image, prompt_for, sampling_for

    engine = build_engine(model, ParserOptions.preset("fast", threads=threads))
    image = layout_image(Image.open(workload / "images" / PAGES[0]).convert("RGB"))
    encoded = engine.preprocessor.encode(GenerationRequest(image, prompt_for(LAYOUT_TASK), sampling_for(LAYOUT_TASK)))
    runner = make_vision_runner(engine.vision, mode)
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            runner(encoded.pixel_values, [encoded.grid_thw])
            times.append(time.perf_counter() - start)
    peak = peak_rss_bytes() / 1e9
    return {"mode": mode, "first_s": times[0], "steady_s": times[1], "peak_rss_gb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("compare_engines.json"))
    ap.add_argument("--skip-vision-modes", action="store_true", help="do not time eager / trace / compile vision")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # internal: run one config/measure in-process
    args = ap.parse_args()
    if args.model:
        model = args.model
    else:
        from mineru_fast.engine.synthetic import cached_synthetic_model

        model = cached_synthetic_model("full", seed=0)
    if not trace_dir(args.workload).is_dir():
        from mineru_fast.protocol.traces import build_omnidocbench_traces

        build_omnidocbench_traces(
            args.workload / "annotations.json", args.workload / "images", trace_dir(args.workload)
        )
    if args.only:
        kind, _, name = args.only.partition(":")
        result = {
            "config": lambda: run_config(name, model, args.workload, args.threads),
            "decode": lambda: decode_steps(model, args.threads),
            "vision": lambda: vision_mode(model, args.workload, args.threads, name),
        }[kind]()
        print(json.dumps(result))
        return
    results: dict = {"model": str(model), "threads": args.threads, "pages": PAGES, "configs": []}
    results["vision"] = []
    modes = [] if args.skip_vision_modes else ["vision:eager", "vision:trace", "vision:compile"]
    for job in [*(f"config:{c}" for c in CONFIGS), "decode:", *modes]:
        cmd = [sys.executable, __file__, "--model", str(model), "--workload", str(args.workload),
               "--threads", str(args.threads), "--only", job]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
            value = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            detail = getattr(exc, "stderr", "") or ""
            value = {"error": f"{type(exc).__name__}: {detail.strip().splitlines()[-1] if detail.strip() else exc}"}
        if job.startswith("config"):
            results["configs"].append(value)
        elif job.startswith("vision"):
            results["vision"].append({"mode": job.split(":")[1], **value})
        else:
            results["decode"] = value
        print(f"done {job}", file=sys.stderr, flush=True)
    results["configs"] = [c for c in results["configs"] if "error" not in c] or results["configs"]
    base = results["configs"][0]
    for c in results["configs"]:
        c["speedup"] = c["pages_per_min"] / base["pages_per_min"]
        c["markdown_equal"] = c["markdown"] == base["markdown"]
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results))


def report(results: dict) -> str:
    lines = [
        f"model {results['model']}, {results['threads']} threads, pages: {', '.join(results['pages'])}",
        "",
        "| config | pages/min | speed-up | vision s | prefill s | decode s | tokens | peak RSS GB | load s "
        "| same Markdown |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["configs"]:
        t = c["timings"]
        lines.append(
            f"| {c['preset']} | {c['pages_per_min']:.2f} | {c['speedup']:.2f}x | {t['vision']:.1f} "
            f"| {t['prefill']:.1f} | {t['decode']:.1f} | {int(c['tokens'])} | {c['peak_rss_gb']:.2f} "
            f"| {c['load_s']:.1f} | {c['markdown_equal']} |"
        )
    d = results["decode"]
    lines += ["", f"fast LM decode: batch 1 {d['batch1_ms_per_step']:.1f} ms/step "
              f"({d['batch1_tokens_per_s']:.1f} tok/s), "
              f"batch 16 {d['batch16_ms_per_step']:.1f} ms/step ({d['batch16_tokens_per_s']:.1f} tok/s)"]  # fmt: skip
    lines += ["", "| vision mode | first call s | steady s | peak RSS GB |", "|---|---|---|---|"]
    for v in results["vision"]:
        if "error" in v:
            lines.append(f"| {v['mode']} | {v['error']} | | |")
        else:
            lines.append(f"| {v['mode']} | {v['first_s']:.1f} | {v['steady_s']:.1f} | {v['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
