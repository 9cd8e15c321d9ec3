"""Peak memory against document length: a short and a long PDF through the CLI and through serve.

    python benchmarks/long_document_memory.py --model DIR [--pages 10 1000] [--doors cli serve]
        [--threads N] [-o FILE]

Each PDF is made here with Pillow (Letter pages, rendered at the default 200 DPI as 1700x2200 RGB,
about 11 MB each) and parsed with the tiny model replaying a four-block page, so every page runs
the whole pipeline (render, layout, crops, content requests, writer) in bounded time. Peak RSS is
the process's own high-water mark (``VmHWM`` in ``/proc/<pid>/status``): the CLI's polled while it
runs, the server's read after each job (one server, the short document first). The script also
checks that the CLI has written the first page's outputs while later pages are still running.
The JSON file is rewritten after every parse, so a stopped run keeps what it measured; the two
doors can run as two processes at once (``--doors cli`` and ``--doors serve``, other ``-o``): each
figure is its own process's peak, so they do not disturb each other's memory figures.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from samples import sample_trace  # noqa: E402 (the test helpers' replay trace)


def letter_pdf(pages: int) -> bytes:
    """``pages`` Letter-size pages (850x1100 at 100 DPI) with a few lines of text each."""
    page = Image.new("RGB", (850, 1100), "white")
    draw = ImageDraw.Draw(page)
    for i in range(20):
        draw.text((60, 60 + 48 * i), f"Line {i} of a long synthetic document.", fill="black")
    buf = io.BytesIO()
    page.save(buf, format="PDF", save_all=True, append_images=[page] * (pages - 1), resolution=100.0)
    return buf.getvalue()


def vm_hwm(pid: int) -> int:
    """The process's peak resident set size in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def run_cli(model: str, pdf: Path, trace: Path, out: Path, threads: int) -> dict:
    command = [sys.executable, "-m", "mineru_fast", "parse", str(pdf), "-o", str(out), "--model", model,
               "--replay", str(trace), "--preset", "exact", "--progress", "none",
               "--threads", str(threads)]  # fmt: skip
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, first_page_s = 0, None
    first_page = out / pdf.stem / "middle_json.json.pages.part"  # the bundle's middle JSON pages, as written
    while process.poll() is None:
        peak = max(peak, vm_hwm(process.pid))
        if first_page_s is None and first_page.is_file() and first_page.stat().st_size > 0:
            first_page_s = time.perf_counter() - start
        time.sleep(0.2)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"parse exited {process.returncode}: {stderr[-2000:]}")
    return {"peak_rss_gb": peak / 1e9, "wall_s": time.perf_counter() - start,
            "first_page_written_after_s": first_page_s, "stdout": stdout.strip()}  # fmt: skip


def run_serve(
    model: str, pdfs: dict[int, bytes], traces: dict[int, bytes], work: Path, threads: int, save
) -> dict[int, dict]:
    """One server; each document as a job, the server's peak RSS read after each (they grow in
    order); ``save(figures)`` after each job."""
    import httpx
    from serve_helpers import running_server

    out: dict[int, dict] = {}
    args = ("--allow-replay", "--max-pages", str(max(pdfs)), "--max-upload-mb", "500", "--threads", str(threads))
    with running_server(Path(model), work, *args, ready_timeout=600) as server:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for pages in sorted(pdfs):
                start = time.perf_counter()
                files = {"file": ("doc.pdf", pdfs[pages]), "replay": ("trace.json", traces[pages])}
                job = client.post("/v1/jobs", files=files, data={"formats": "markdown"}).json()
                while client.get(job["status_url"]).json()["status"] in ("queued", "running"):
                    time.sleep(1.0)
                result = client.get(job["result_url"]).json()
                assert result["status"] == "success" and result["page_count"] == pages, result.get("status")
                out[pages] = {"peak_rss_gb": vm_hwm(server.process.pid) / 1e9, "wall_s": time.perf_counter() - start}
                save(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (the tiny synthetic model)")
    ap.add_argument("--pages", type=int, nargs="+", default=[10, 1000])
    ap.add_argument("--doors", nargs="+", choices=["cli", "serve"], default=["cli", "serve"])
    ap.add_argument("--threads", type=int, default=2, help="threads of the parse / server (default 2)")
    ap.add_argument("-o", "--output", type=Path, default=Path("long_document_memory.json"))
    args = ap.parse_args()
    results: dict = {"pages": args.pages, "threads": args.threads, "cli": {}, "serve": {}}

    def save(door: str, figures: dict) -> None:
        results[door] = figures
        args.output.write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pdfs, traces = {}, {}
        for pages in args.pages:
            pdfs[pages] = letter_pdf(pages)
            (work / f"doc{pages}.pdf").write_bytes(pdfs[pages])
            sample_trace(pages).save(work / f"doc{pages}.json")
            traces[pages] = (work / f"doc{pages}.json").read_bytes()
        for pages in args.pages if "cli" in args.doors else []:
            print(f"[memory] cli, {pages} pages ...", file=sys.stderr, flush=True)
            figures = run_cli(
                args.model, work / f"doc{pages}.pdf", work / f"doc{pages}.json", work / "out", args.threads
            )
            save("cli", {**results["cli"], pages: figures})
        if "serve" in args.doors:
            print("[memory] serve ...", file=sys.stderr, flush=True)
            run_serve(args.model, pdfs, traces, work, args.threads, lambda figures: save("serve", dict(figures)))
    short, long = min(args.pages), max(args.pages)
    for door in args.doors:
        a, b = results[door][short], results[door][long]
        print(f"{door}: {short} pages {a['peak_rss_gb']:.2f} GB, {long} pages {b['peak_rss_gb']:.2f} GB "
              f"({b['peak_rss_gb'] / a['peak_rss_gb']:.2f}x), {long} pages in {b['wall_s']:.0f} s")  # fmt: skip
    if "cli" in args.doors:
        first, wall = results["cli"][long]["first_page_written_after_s"], results["cli"][long]["wall_s"]
        seen = "never seen" if first is None else f"on disk after {first:.1f} s"
        print(f"cli: first page's outputs {seen} of the {long}-page parse's {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
