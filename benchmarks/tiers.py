"""The ``standard`` and ``advanced`` tiers side by side in one run, one engine, replayed outputs.

Rows: each tier on the workload's median scanned page (an image input: the standard tier reads
every block with the VLM, at PP-DocLayoutV2's boxes) and on born-digital corpus PDF pages (the
standard tier takes the text-like blocks from the PDF). Both tiers replay the same layout (the
advanced tier as the VLM's layout output, the standard tier as PP-DocLayoutV2 detections,
``LayoutTrace.from_trace``; either model still runs in full) and the same block outputs, so each
row costs what the models producing those outputs cost. The born-digital pages' traces are made
here: blocks from the page's text layer (or given boxes), their outputs the PDF's own text (what a
perfect VLM read returns, with its token count). The standard rows check that every text-like
block equals the PDF's text in its box (``pdftext.block_text``).

    python benchmarks/tiers.py --model DIR --layout-model DIR \\
        [--threads 2] [--preset fast] [--workload DIR] [--corpus DIR] [--out FILE.json]

Without ``--model``/``--layout-model`` the tiny synthetic models are made (a sanity run, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# academic_fig_eq_table_1p.pdf (MinerU's own test page), boxes read off its 200 DPI render:
# a figure, its caption, a display equation, a paragraph, a (rotated) table and its caption, the
# page number. Table and equation outputs are what MinerU2.5 writes for them (OTSL, LaTeX).
MIXED_PAGE = [
    ("image", (0.212, 0.159, 0.398, 0.384), None),
    ("image_caption", (0.212, 0.403, 0.398, 0.421), ""),
    ("equation", (0.115, 0.455, 0.495, 0.493), "C(p,\\bar{p}) \\leftarrow \\frac{(1-\\lambda)\\cdot C(p,\\bar{p})"
     "+\\lambda\\cdot w_t(p,p_{t-1})\\cdot C_a(p,\\bar{p})}{(1-\\lambda)+\\lambda\\cdot w_t(p,p_{t-1})}\\tag{1}"),
    ("text", (0.115, 0.507, 0.495, 0.584), ""),
    ("table_caption", (0.628, 0.366, 0.798, 0.382), ""),
    ("table", (0.584, 0.383, 0.668, 0.643), "<fcel>Model<fcel>R^2<fcel>Testing Error<nl>"
     "<fcel>Linear Regression<fcel>0.98740<fcel>1321.2<nl><fcel>Linear Regression<fcel>0.98740<fcel>1321.2<nl>"
     "<fcel>Gray Prediction<fcel>0.00617<fcel>687<nl>"),
    ("page_number", (0.49, 0.876, 0.51, 0.892), ""),
]  # fmt: skip


class CountingEngine:
    """Passes requests to the shared engine and counts them and their tokens."""

    def __init__(self, engine) -> None:
        self.engine, self.lock = engine, threading.Lock()
        self.requests = self.prompt_tokens = self.generated_tokens = 0

    def submit(self, request):
        handle = self.engine.submit(request)
        handle.future.add_done_callback(self._count)
        return handle

    def _count(self, future) -> None:
        result = future.result()
        with self.lock:
            self.requests += 1
            self.prompt_tokens += result.prompt_tokens
            self.generated_tokens += len(result.token_ids)

    def reset(self) -> dict:
        with self.lock:
            out = {"vlm_requests": self.requests, "prompt_tokens": self.prompt_tokens,
                   "generated_tokens": self.generated_tokens}  # fmt: skip
            self.requests = self.prompt_tokens = self.generated_tokens = 0
        return out


def text_blocks(text, gap: float = 1.2) -> list[tuple[str, tuple[float, float, float, float], str]]:
    """Text blocks of a two-column page from its text layer: characters split at the page's middle,
    grouped into lines, lines into blocks at vertical gaps over ``gap`` line heights."""
    chars = [c for c in text.chars if not c.generated and not c.text.isspace()]
    blocks = []
    for left in (True, False):
        column = sorted((c for c in chars if ((c.bbox[0] + c.bbox[2]) / 2 < 0.5) == left), key=lambda c: c.bbox[1])
        lines: list[list] = []
        for char in column:
            middle = (char.bbox[1] + char.bbox[3]) / 2
            if lines and abs(middle - statistics.mean((c.bbox[1] + c.bbox[3]) / 2 for c in lines[-1][-3:])) < 0.004:
                lines[-1].append(char)
            else:
                lines.append([char])
        group: list[list] = []
        for line in lines:
            height = max(c.bbox[3] - c.bbox[1] for c in line)
            if group and min(c.bbox[1] for c in line) - max(c.bbox[3] for c in group[-1]) > gap * height:
                blocks.append(_box(group))
                group = []
            group.append(line)
        if group:
            blocks.append(_box(group))
    return [("text", box, "") for box in blocks if box[2] - box[0] > 0.01 and box[3] - box[1] > 0.005]


def _box(lines: list[list]) -> tuple[float, float, float, float]:
    chars = [c for line in lines for c in line]
    pad = 0.002
    return (
        max(0.0, min(c.bbox[0] for c in chars) - pad),
        max(0.0, min(c.bbox[1] for c in chars) - pad),
        min(1.0, max(c.bbox[2] for c in chars) + pad),
        min(1.0, max(c.bbox[3] for c in chars) + pad),
    )


def born_digital_trace(pdf: Path, index: int, blocks=None):
    """A replay trace of page ``index`` of a PDF (every page present, only that one filled): the
    given ``(type, box, content)`` blocks or the text layer's blocks; content ``""`` = the PDF's
    text in the box, None = not read."""
    from mineru_fast.inputs.documents import open_document
    from mineru_fast.inputs.pdftext import block_text
    from mineru_fast.protocol.traces import PageTrace, Trace

    with open_document(pdf) as opened:
        text = opened.page_text(index)
        count = opened.page_count
    assert text is not None
    blocks = blocks if blocks is not None else text_blocks(text)
    lines, contents = [], []
    for kind, box, content in blocks:
        x1, y1, x2, y2 = (round(v * 1000) for v in box)
        lines.append(f"<|box_start|>{x1:03d} {y1:03d} {x2:03d} {y2:03d}<|box_end|><|ref_start|>{kind}<|ref_end|>")
        contents.append(block_text(text, box).text if content == "" else content)
    pages = [PageTrace("") for _ in range(count)]
    pages[index] = PageTrace("\n".join(lines), contents)
    return Trace(pages)


def text_identical(page, pdf: Path) -> tuple[int, int]:
    """(text-like blocks equal to the PDF's text in their box, text-like blocks) of a parsed page."""
    from mineru_fast.inputs.documents import open_document
    from mineru_fast.inputs.pdftext import block_text
    from mineru_fast.pipeline.standard import TEXT_FROM_PDF

    with open_document(pdf) as opened:
        text = opened.page_text(page.index)
    assert text is not None
    blocks = [b for b in page.blocks if b.type in TEXT_FROM_PDF and b.raw is None]
    same = sum(b.content == block_text(text, b.bbox).text for b in blocks)
    return same, len([b for b in page.blocks if b.type in TEXT_FROM_PDF])


def run(args: argparse.Namespace) -> dict:
    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.bench.rows import warm_up
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.engine.memory import peak_rss_bytes
    from mineru_fast.layout import LayoutDetector
    from mineru_fast.protocol.layout_trace import LayoutTrace
    from mineru_fast.protocol.traces import Trace

    options = ParserOptions.preset(args.preset, threads=args.threads, tier="advanced")
    start = time.perf_counter()
    advanced = DocumentParser.from_pretrained(args.model, options)
    load_s = time.perf_counter() - start
    engine = CountingEngine(advanced.engine)
    start = time.perf_counter()
    detector = LayoutDetector.from_pretrained(
        args.layout_model, backend=args.layout_backend, threads=args.threads, batch_size=options.page_window
    )
    layout_load_s = time.perf_counter() - start
    parsers = {
        "advanced": DocumentParser(engine, options, advanced.model_dir, advanced.model_info),
        "standard": DocumentParser(
            engine,
            replace(options, tier="standard", layout_model=str(args.layout_model), layout_backend=args.layout_backend),
            advanced.model_dir,
            advanced.model_info,
            detector,
        ),
    }
    warm_up(advanced)
    scanned = load_workload(1, args.workload if args.workload and args.workload.is_dir() else None)[0]
    detector.detect([scanned.image])  # first-call costs of the layout model
    engine.reset()
    inputs = [("scanned (image): " + scanned.name, [scanned.image], None, Trace([scanned.trace]), None)]
    corpus = args.corpus
    if corpus is not None and (corpus / "academic_tableformer_10p.pdf").is_file():
        pdf = corpus / "academic_tableformer_10p.pdf"
        inputs.append(("born-digital: academic_tableformer_10p.pdf p2", pdf, "2", born_digital_trace(pdf, 1), pdf))
        pdf = corpus / "academic_fig_eq_table_1p.pdf"
        inputs.append(
            ("born-digital: academic_fig_eq_table_1p.pdf p1", pdf, "1", born_digital_trace(pdf, 0, MIXED_PAGE), pdf)
        )
    rows = []
    for name, source, pages, trace, pdf in inputs:
        for tier, parser in parsers.items():
            layouts = LayoutTrace.from_trace(trace) if tier == "standard" else None
            start = time.perf_counter()
            document = parser.parse(source, pages=pages, replay=trace, layout_replay=layouts)
            wall = time.perf_counter() - start
            (page,) = document.pages
            row = {"page": name, "tier": tier, "wall_s": round(wall, 2), "status": page.status,
                   "ocr_mode": page.ocr_mode, "blocks": len(page.blocks),
                   "timings": {k: round(v, 2) for k, v in page.timings.items()}, **engine.reset()}  # fmt: skip
            if tier == "standard" and pdf is not None:
                row["text_blocks_identical"] = "{}/{}".format(*text_identical(page, pdf))
            row["problems"] = page.errors + page.warnings
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    for row in rows:
        if row["tier"] == "standard":
            other = next(r for r in rows if r["page"] == row["page"] and r["tier"] == "advanced")
            row["speedup_vs_advanced"] = round(other["wall_s"] / row["wall_s"], 2)
    return {
        "model": str(args.model),
        "layout_model": detector.identity(),
        "preset": args.preset,
        "threads": args.threads,
        "load_s": round(load_s, 1),
        "layout_load_s": round(layout_load_s, 1),
        "peak_rss_gb": round(peak_rss_bytes() / 1e9, 2),
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"model: {result['model']}; layout model: {result['layout_model']}; preset {result['preset']}, "
        f"{result['threads']} threads",
        "",
        "| page | tier | ocr_mode | wall s | layout model s | vision s | decode s | VLM requests | generated tokens "
        "| text blocks = PDF | speed-up | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t = r["timings"]
        lines.append(
            f"| {r['page']} | {r['tier']} | {r['ocr_mode']} | {r['wall_s']} | {t.get('layout_model', '-')} "
            f"| {t.get('vision', 0)} | {t.get('decode', 0)} | {r['vlm_requests']} | {r['generated_tokens']} "
            f"| {r.get('text_blocks_identical', '-')} | {r.get('speedup_vs_advanced', '-')} | {r['status']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="MinerU2.5 checkpoint (default: a tiny synthetic one)")
    ap.add_argument("--layout-model", type=Path, help="PP-DocLayoutV2 folder or .onnx (default: tiny synthetic)")
    ap.add_argument("--layout-backend", default="auto", choices=("auto", "onnx", "torch"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--workload", type=Path, default=SHARED / "workloads" / "omnidocbench_demo")
    ap.add_argument("--corpus", type=Path, default=SHARED / "corpus")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    from mineru_fast.runtime.threads import configure_process

    configure_process(args.threads, bind=True)
    if args.model is None or args.layout_model is None:
        import tempfile

        from mineru_fast.engine.synthetic import make_synthetic_model
        from mineru_fast.layout.synthetic import make_synthetic_doclayout

        scratch = Path(tempfile.mkdtemp(prefix="tiers-"))
        args.model = args.model or make_synthetic_model(scratch / "vlm", size="tiny", seed=0)
        args.layout_model = args.layout_model or make_synthetic_doclayout(scratch / "layout", "tiny", onnx=False)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
