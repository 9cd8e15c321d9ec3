"""Write mineru_fast/assets/workload_profile.json from OmniDocBench-format ground truth.

The profile keeps figures only (page sizes, block types and boxes, token counts of each step's
output), so the benchmark can synthesize pages and replay traces of the same shape from a plain
install. Usage:

    python scripts/make_workload_profile.py ../shared/workloads/omnidocbench_demo
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from mineru_fast.engine.synthetic import make_synthetic_model
from mineru_fast.protocol.traces import build_omnidocbench_traces, layout_lines, load_trace

OUT = Path(__file__).resolve().parents[1] / "mineru_fast" / "assets" / "workload_profile.json"


def main(workload: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(make_synthetic_model(Path(tmp) / "tiny", "tiny"))
        paths = build_omnidocbench_traces(workload / "annotations.json", workload / "images", Path(tmp) / "traces")
        pages = []
        for path in paths:
            from PIL import Image

            image_path = next((workload / "images").glob(path.stem + ".*"))
            with Image.open(image_path) as im:
                width, height = im.size
            trace = load_trace(path).pages[0]
            blocks = layout_lines(trace.layout)
            pages.append(
                {
                    "name": path.stem,
                    "width": width,
                    "height": height,
                    "layout_tokens": len(tokenizer.encode(trace.layout)),
                    "blocks": [
                        {
                            "type": b.type,
                            "bbox": [round(v * 1000) for v in b.bbox],
                            "tokens": None if c is None else len(tokenizer.encode(c)),
                        }
                        for b, c in zip(blocks, trace.contents, strict=True)
                    ],
                }
            )
    source = "OmniDocBench demo_data (Apache-2.0): page sizes, block boxes/types and token counts only"
    OUT.write_text(json.dumps({"source": source, "pages": pages}, indent=1) + "\n")
    print(f"wrote {len(pages)} page profiles to {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
