"""Parse ``examples/sample.pdf`` end to end and show what comes out.

    python examples/parse_sample.py [-o OUT_DIR]

No model download: the script writes a tiny random-weight model of MinerU2.5's architecture
(seconds). Random weights produce meaningless text, so the parse replays ``sample_trace.json``:
the engine is forced to emit those outputs (a title, a text block and a ruled table per page)
while running every forward pass, which shows the real pipeline and its real output formats. With
the published weights, drop ``replay=`` and load the default model (``DocumentParser.from_pretrained()``).

In a notebook, ``document`` displays as its Markdown and ``document.pages[0]`` as its layout
overlay (``Page._repr_png_``); this script writes the same overlay to a PNG file instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.engine.synthetic import make_synthetic_model

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=Path("example-output"), help="default: %(default)s")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_synthetic_model(Path(tmp) / "tiny", size="tiny")
        # the "fast" preset; prepared_cache=False: a throwaway model gets no entry in the prepared-model cache
        parser = DocumentParser.from_pretrained(model, ParserOptions(progress=False), prepared_cache=False)
        # keep_page_images: the overlay below draws on the page image (released by default)
        document = parser.parse(HERE / "sample.pdf", replay=HERE / "sample_trace.json", keep_page_images=True)
    print(f"{document.name}: {document.status}, {len(document.pages)} page(s), model {parser.model_info.to_dict()}")
    print("seconds by stage:", {k: round(v, 3) for k, v in document.timings.items()}, "counts:", document.counts)
    meta = document.metadata or {}
    print(f"schema {meta.get('schema_version')}, input {meta.get('input')}, model {meta.get('model')}")
    # Random weights find the replayed text improbable: every block's mean log-probability is very low.
    print(
        "block confidence:",
        [(b.type, b.confidence and round(b.confidence.mean_logprob, 2)) for b in document.pages[0].blocks],
    )
    print("\n--- Markdown ---\n" + document.to_markdown())
    print("--- content_list.json, first item ---")
    print(json.dumps(document.to_content_list()[0], indent=1))
    out = document.save(args.output / document.name)
    overlay = args.output / "page1_overlay.png"
    overlay.write_bytes(document.pages[0]._repr_png_() or b"")
    print("--- written ---")
    for path in sorted(p for p in args.output.rglob("*") if p.is_file()):
        print(f"{path}  ({path.stat().st_size:,} bytes)")
    print(f"saved to {out}")
    return 0 if document.status == "success" and overlay.stat().st_size > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
