"""Layout replay traces: the detections a layout pass must produce, page by page.

A layout trace is one JSON object per document::

    {"layout_model": "PP-DocLayoutV2",
     "pages": [{"detections": [{"label": "text", "score": 0.97, "bbox": [x0, y0, x1, y1]}, ...]}, ...]}

``pages[i]`` is the i-th parsed page; its detections are the detector's thresholded regions in
reading order (``postprocess.select_rows`` output), labels from ``labels.LABELS``, boxes
normalized to the page image (0..1; a detector may reach slightly past the page, post-processing
clips). With a trace, ``LayoutDetector.detect`` still runs the model on every page (the cost is
paid) and then post-processes the trace's detections instead of the model's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mineru_fast.errors import TraceError
from mineru_fast.layout.labels import LABEL_BY_BLOCK_TYPE, LABELS
from mineru_fast.layout.postprocess import Detection, PageLayout, as_box, scale_box
from mineru_fast.protocol.traces import Trace, layout_lines

__all__ = ["LayoutTrace", "load_layout_trace", "detections_from_blocks"]

MODEL_NAME = "PP-DocLayoutV2"


@dataclass
class LayoutTrace:
    """Detections of one document, page by page (boxes normalized to each page, 0..1)."""

    pages: list[list[Detection]]

    def to_dict(self) -> dict:
        return {
            "layout_model": MODEL_NAME,
            "pages": [
                {"detections": [{"label": d.label, "score": d.score, "bbox": list(d.bbox)} for d in page]}
                for page in self.pages
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")

    @classmethod
    def from_dict(cls, data: object, source: str = "layout trace") -> LayoutTrace:
        """Validate decoded JSON.

        Raises:
            TraceError: any structure or value other than the schema in the module docstring.
        """
        if not isinstance(data, dict) or not isinstance(data.get("pages"), list):
            raise TraceError(f"{source}: expected an object with a 'pages' list")
        pages = data["pages"]
        if data.get("layout_model", MODEL_NAME) != MODEL_NAME:
            raise TraceError(f"{source}: recorded for {data['layout_model']!r}, not {MODEL_NAME}")
        out: list[list[Detection]] = []
        for i, page in enumerate(pages):
            items = page.get("detections") if isinstance(page, dict) else None
            if not isinstance(items, list):
                raise TraceError(f"{source}: page {i} needs a 'detections' list")
            out.append([_detection(item, f"{source}: page {i} detection {j}") for j, item in enumerate(items)])
        return cls(out)

    @classmethod
    def from_trace(cls, trace: object) -> LayoutTrace:
        """Detections that replay a VLM trace's layout (``traces.Trace``) through the standard tier.

        Each layout line becomes a detection of the label that yields its type
        (``LABEL_BY_BLOCK_TYPE``), score 1.0, same box; lines of types the detector has no label
        for (``unknown``, ``inline_formula``, ``image_block``) are left out. The VLM trace's
        contents then replay the standard tier's reads (``traces.PageTrace.content_near``).
        """
        if not isinstance(trace, Trace):
            raise TraceError(f"expected a traces.Trace, got {type(trace).__name__}")
        pages = []
        for page in trace.pages:
            lines = [(b.type, b.bbox) for b in layout_lines(page.layout) if b.type in LABEL_BY_BLOCK_TYPE]
            pages.append(detections_from_blocks(lines))
        return cls(pages)

    @classmethod
    def from_layouts(cls, layouts: Iterable[PageLayout]) -> LayoutTrace:
        """Record what a real layout pass detected (``PageLayout.detections``), normalized."""
        pages = []
        for layout in layouts:
            sx, sy = 1 / layout.image_size[0], 1 / layout.image_size[1]
            pages.append([Detection(d.label, d.score, scale_box(d.bbox, sx, sy)) for d in layout.detections])
        return cls(pages)


def _detection(item: object, where: str) -> Detection:
    if not isinstance(item, dict):
        raise TraceError(f"{where}: expected an object")
    label, score, bbox = item.get("label"), item.get("score"), item.get("bbox")
    if label not in LABELS:
        raise TraceError(f"{where}: unknown label {label!r}")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
        raise TraceError(f"{where}: score must be a number in [0, 1], got {score!r}")
    if (
        not isinstance(bbox, list)
        or len(bbox) != 4
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox)
    ):
        raise TraceError(f"{where}: bbox must be 4 finite numbers, got {bbox!r}")
    return Detection(label, float(score), as_box(bbox))


def load_layout_trace(path: str | Path) -> LayoutTrace:
    """Read and validate a layout trace file.

    Raises:
        TraceError: unreadable file, invalid JSON or a structure other than the schema.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: cannot read layout trace ({exc})") from exc
    return LayoutTrace.from_dict(data, str(path))


def detections_from_blocks(blocks: Sequence[tuple[str, Sequence[float]]]) -> list[Detection]:
    """A page's VLM-style blocks ``(type, normalized bbox)`` -> detections to replay, score 1.0.

    Raises:
        TraceError: a block type with no PP-DocLayoutV2 label (``LABEL_BY_BLOCK_TYPE``).
    """
    out = []
    for block_type, bbox in blocks:
        label = LABEL_BY_BLOCK_TYPE.get(block_type)
        if label is None:
            raise TraceError(f"block type {block_type!r} has no PP-DocLayoutV2 label")
        out.append(Detection(label, 1.0, as_box(bbox)))
    return out
