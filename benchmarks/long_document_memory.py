"""Peak memory against document length: a short and a long PDF through the CLI and through serve.

    python benchmarks/long_document_memory.py --model DIR [--pages 10 1000] [-o FILE]

Each PDF is made here with Pillow (Letter pages, rendered at the default 200 DPI as 1700x2200 RGB,
about 11 MB each) and parsed with the tiny model replaying a four-block page, so every page runs
the whole pipeline (render, layout, crops, content requests, writer) in bounded time. Peak RSS is
the process's own high-water mark (``VmHWM`` in ``/proc/<pid>/status``): the CLI's polled while it
runs, the server's read after each job (one server, the short document first). The script also
checks that the CLI has written the first page's outputs while later pages are still running.
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


def run_cli(model: str, pdf: Path, trace: Path, out: Path) -> dict:
    command = [sys.executable, "-m", "mineru_fast", "parse", str(pdf), "-o", str(out), "--model", model,
               "--replay", str(trace), "--preset", "exact", "--progress", "none"]  # fmt: skip
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, first_page_early = 0, False
    while process.poll() is None:
        peak = max(peak, vm_hwm(process.pid))
        first = out / pdf.stem / "layout" / "page_0001.png"
        first_page_early = first_page_early or first.is_file()
        time.sleep(0.2)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"parse exited {process.returncode}: {stderr[-2000:]}")
    return {"peak_rss_gb": peak / 1e9, "wall_s": time.perf_counter() - start,
            "first_page_written_while_running": first_page_early, "stdout": stdout.strip()}  # fmt: skip


def run_serve(model: str, pdfs: dict[int, bytes], traces: dict[int, bytes], work: Path) -> dict[int, dict]:
    """One server; each document as a job, the server's peak RSS read after each (they grow in order)."""
    import httpx
    from serve_helpers import running_server

    out = {}
    args = ("--allow-replay", "--max-pages", str(max(pdfs)), "--max-upload-mb", "500", "--threads", "2")
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
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (the tiny synthetic model)")
    ap.add_argument("--pages", type=int, nargs="+", default=[10, 1000])
    ap.add_argument("-o", "--output", type=Path, default=Path("long_document_memory.json"))
    args = ap.parse_args()
    results: dict = {"pages": args.pages, "cli": {}, "serve": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pdfs, traces = {}, {}
        for pages in args.pages:
            pdfs[pages] = letter_pdf(pages)
            (work / f"doc{pages}.pdf").write_bytes(pdfs[pages])
            sample_trace(pages).save(work / f"doc{pages}.json")
            traces[pages] = (work / f"doc{pages}.json").read_bytes()
        for pages in args.pages:
            print(f"[memory] cli, {pages} pages ...", file=sys.stderr, flush=True)
            results["cli"][pages] = run_cli(
                args.model, work / f"doc{pages}.pdf", work / f"doc{pages}.json", work / "out"
            )
        print("[memory] serve ...", file=sys.stderr, flush=True)
        results["serve"] = run_serve(args.model, pdfs, traces, work)
    args.output.write_text(json.dumps(results, indent=1))
    short, long = min(args.pages), max(args.pages)
    for door in ("cli", "serve"):
        a, b = results[door][short], results[door][long]
        print(f"{door}: {short} pages {a['peak_rss_gb']:.2f} GB, {long} pages {b['peak_rss_gb']:.2f} GB "
              f"({b['peak_rss_gb'] / a['peak_rss_gb']:.2f}x), {long} pages in {b['wall_s']:.0f} s")  # fmt: skip
    early = results["cli"][long]["first_page_written_while_running"]
    print(f"cli: first page's outputs on disk while later pages ran: {early}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
