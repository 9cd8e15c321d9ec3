"""Peak memory of turning one page into RGB (``OpenedDocument.render``), per source kind.

A blank page of ``--side`` x ``--side`` pixels (a PNG or TIFF of that Pillow mode, or a PDF page
that renders to that size) is written to a file; a fresh process (which never held the page's
pixels) reads it, opens it and renders it once; the figure is the growth of its peak resident set
size (``VmHWM``, reset before the render: Linux only) over its resident size before the
render, divided by the page's pixels; for "pdf, render process" (``render_timeout`` set: the page
is rendered in a child process) the growth of both processes, the child started by a small
first page. These are
the per-pixel figures of ``OpenedDocument.page_cost`` (``mineru_fast.inputs.documents``).

    python benchmarks/decode_memory.py [--side 4000]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ["RGBA", "LA", "P", "RGB", "L", "CMYK", "I;16", "I", "F", "pdf", "pdf, render process"]


def page_bytes(kind: str, side: int) -> bytes:
    """A blank page of ``side`` x ``side`` pixels as the file bytes of this kind."""
    from PIL import Image

    buffer = io.BytesIO()
    if kind.startswith("pdf"):
        import pypdfium2 as pdfium

        pdf = pdfium.PdfDocument.new()
        if kind != "pdf":
            pdf.new_page(72, 72)  # a small first page: it starts the render process
        pdf.new_page(side * 72 / 200, side * 72 / 200)  # rendered at the default 200 DPI
        pdf.save(buffer)
        return buffer.getvalue()
    Image.new(kind, (side, side)).save(buffer, format="PNG" if kind in ("RGBA", "LA", "P", "RGB", "L") else "TIFF")
    return buffer.getvalue()


def _status_bytes(field: str, pid: str = "self") -> int:
    """A ``kB`` field of ``/proc/PID/status`` in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: str = "self") -> int:
    """Start the peak resident size (``VmHWM``) of a process again from its resident size (Linux);
    returns that resident size in bytes."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")
    return _status_bytes("VmRSS", pid)


def one(path: Path, side: int, render_timeout: float | None) -> dict:
    from mineru_fast.inputs.documents import open_document

    opened = open_document(path.read_bytes(), decode_first=False, max_side=side, render_timeout=render_timeout)
    pids = ["self"]
    if render_timeout is not None:  # the render process is started by a small first page; its growth counts too
        opened.render(0)
        pids.append(str(opened._renderer._process.pid))  # type: ignore[union-attr]
    before = [_reset_peak(pid) for pid in pids]
    image = opened.render(opened.page_count - 1)
    grown = sum(_status_bytes("VmHWM", pid) - base for pid, base in zip(pids, before, strict=True))
    return {"size": list(image.size), "bytes_per_pixel": round(grown / side**2, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=4000)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--render-timeout", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        print(json.dumps(one(Path(args.only), args.side, args.render_timeout)))
        return
    print("| source | peak bytes per pixel |\n|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in CASES:
            path = Path(folder) / "page"
            path.write_bytes(page_bytes(kind, args.side))
            extra = ["--render-timeout", "600"] if kind == "pdf, render process" else []
            out = subprocess.run(
                [sys.executable, __file__, "--only", str(path), "--side", str(args.side), *extra],
                capture_output=True,
                text=True,
                check=True,
            )
            print(f"| {kind} | {json.loads(out.stdout)['bytes_per_pixel']} |")


if __name__ == "__main__":
    main()
