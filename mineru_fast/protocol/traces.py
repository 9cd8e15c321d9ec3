"""Replay traces: the exact outputs a parse must produce, and a builder from OmniDocBench.

A trace file holds one JSON object per input document::

    {"pages": [{"layout": "<raw layout-step text>",
                "contents": ["<raw content-step text>" or null, ...]}, ...]}

``pages[i]`` is the document's i-th page (0-based, whatever page range is parsed);
``contents[j]`` is the raw output for the j-th block of the parsed layout, null for a block that
is not read. Engines force these outputs token by token while computing everything in full, so a
replayed parse costs what the real model producing that output costs.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from PIL import Image

from mineru_fast.errors import TraceError
from mineru_fast.layout.labels import LABEL_BY_BLOCK_TYPE
from mineru_fast.protocol.page import RAW_TYPE_KEY
from mineru_fast.protocol.spec import LayoutBlock

logger = logging.getLogger(__name__)

__all__ = [
    "PageTrace",
    "Trace",
    "load_trace",
    "trace_from_dict",
    "html_to_otsl",
    "build_omnidocbench_traces",
    "layout_lines",
    "model_math",
    "OMNIDOCBENCH_TYPES",
]


# One layout line: box, type and optional rotate token (mineru-vl-utils 2.0.x grammar).
_LAYOUT_LINE_RE = re.compile(
    r"<\|box_start\|>(\d+)\s+(\d+)\s+(\d+)\s+(\d+)<\|box_end\|><\|ref_start\|>(\w+?)<\|ref_end\|>"
    r"(<\|rotate_(?:up|right|down|left)\|>)?"
)
_ROTATE_ANGLES = {"<|rotate_up|>": 0, "<|rotate_right|>": 90, "<|rotate_down|>": 180, "<|rotate_left|>": 270}


def layout_line_key(x1: int, y1: int, x2: int, y2: int, block_type: str, angle: int | None) -> tuple:
    """The key that ties a layout line to the block parsed from it: normalized box, type, angle."""
    return (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2), block_type, angle)


def layout_lines(layout: str) -> list[LayoutBlock]:
    """Every line of a layout text that has the line grammar, in order: type (lower case), box as
    0..1 floats (corners sorted), angle. ``PageTrace.contents`` runs parallel to this list."""
    lines = []
    for match in _LAYOUT_LINE_RE.finditer(layout):
        a, b, c, d = (int(v) for v in match.group(1, 2, 3, 4))
        x1, y1, x2, y2 = layout_line_key(a, b, c, d, "", None)[:4]
        angle = _ROTATE_ANGLES[match.group(6)] if match.group(6) else None
        lines.append(LayoutBlock(match.group(5).lower(), (x1 / 1000, y1 / 1000, x2 / 1000, y2 / 1000), angle))
    return lines


@dataclass
class PageTrace:
    """Outputs of one page: the layout text and one content text (or None) per layout line.

    ``contents[j]`` belongs to the j-th line of ``layout`` that has the line grammar (whatever its
    type or box), so it stays valid whatever filters the protocol applies to the lines.
    """

    layout: str
    contents: list[str | None] = field(default_factory=list)

    def content_for(self, block: dict) -> str | None:
        """The recorded content of a layout block (a ``protocol.page.PageLayout`` block), or None.

        The block is matched to its line by box, type and angle; a block kept as text for an unknown
        type matches its raw type, and an ``image`` also matches an ``unknown`` line (read as image).
        """
        x1, y1, x2, y2 = (round(v * 1000) for v in block["bbox"])
        table = self._by_key()
        types = [block.get(RAW_TYPE_KEY) or block["type"]] + (["unknown"] if block["type"] == "image" else [])
        for block_type in types:
            if (content := table.get(layout_line_key(x1, y1, x2, y2, block_type, block.get("angle")))) is not None:
                return content
        return None

    def content_near(self, block_type: str, bbox: Sequence[float], tolerance: float = 0.005) -> str | None:
        """The recorded content of a block found by another layout model (the standard tier's
        detector replaying this trace's layout, ``LayoutTrace.from_trace``), or None.

        The detector's post-processing moves boxes to whole pixels (up to 1/480 of a 480-pixel
        page) and then to 3 decimals, and renames types (a ``title`` line comes back as
        ``paragraph_title``), so a line matches when every corner lies within ``tolerance`` (page
        fraction; 0.005 = 5 units of the layout's 0..1000 grid); among those, a line whose type
        maps to the same PP-DocLayoutV2 label is preferred, then the nearest.
        """
        label = LABEL_BY_BLOCK_TYPE.get(block_type, block_type)
        best: tuple[bool, float, str] | None = None
        for line, content in zip(layout_lines(self.layout), self.contents, strict=False):
            if content is None:
                continue
            distance = max(abs(a - b) for a, b in zip(line.bbox, bbox, strict=True))
            if distance > tolerance:
                continue
            key = (LABEL_BY_BLOCK_TYPE.get(line.type, line.type) != label, distance, content)
            if best is None or key[:2] < best[:2]:
                best = key
        return best[2] if best is not None else None

    def _by_key(self) -> dict[tuple, str]:
        table: dict[tuple, str] = {}
        for match, content in zip(_LAYOUT_LINE_RE.finditer(self.layout), self.contents, strict=False):
            if content is None:
                continue
            x1, y1, x2, y2 = (int(v) for v in match.group(1, 2, 3, 4))
            angle = _ROTATE_ANGLES[match.group(6)] if match.group(6) else None
            table.setdefault(layout_line_key(x1, y1, x2, y2, match.group(5).lower(), angle), content)
        return table


@dataclass
class Trace:
    """Outputs of one document, page by page."""

    pages: list[PageTrace]

    def to_dict(self) -> dict:
        return {"pages": [{"layout": p.layout, "contents": p.contents} for p in self.pages]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")


def trace_from_dict(data: object, source: str = "trace") -> Trace:
    """Validate decoded trace JSON and build a ``Trace``.

    Args:
        data: the decoded JSON value.
        source: how error messages name it (a path, "the replay trace", ...).

    Raises:
        TraceError: a structure other than the schema above.
    """
    pages = data.get("pages") if isinstance(data, dict) else None
    if not isinstance(pages, list):
        raise TraceError(f"{source}: expected an object with a 'pages' list")
    out = []
    for i, page in enumerate(pages):
        layout, contents = (page.get("layout"), page.get("contents", [])) if isinstance(page, dict) else (None, None)
        if not isinstance(layout, str) or not isinstance(contents, list):
            raise TraceError(f"{source}: page {i} needs a 'layout' string and a 'contents' list")
        if not all(c is None or isinstance(c, str) for c in contents):
            raise TraceError(f"{source}: page {i} 'contents' must hold strings or nulls")
        out.append(PageTrace(layout, contents))
    return Trace(out)


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file.

    Raises:
        TraceError: unreadable file, invalid JSON, or a structure other than the schema above.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    return trace_from_dict(data, str(path))


class _TableGrid(HTMLParser):
    """Collects ``(rowspan, colspan, text)`` cells row by row from an HTML table."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[tuple[int, int, str]]] = []
        self._cell: list[str] | None = None
        self._span = (1, 1)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            a = dict(attrs)
            self._span = (_int(a.get("rowspan")), _int(a.get("colspan")))
            self._cell = []
            if not self.rows:
                self.rows.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            text = re.sub(r"\s+", " ", "".join(self._cell)).strip()
            self.rows[-1].append((*self._span, text))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _int(value: str | None) -> int:
    try:
        return max(1, int(value or 1))
    except ValueError:
        return 1


def html_table_cells(html_text: str) -> list[list[tuple[int, int, str]]]:
    """Rows of ``(rowspan, colspan, text)`` of an HTML table (inner markup dropped)."""
    parser = _TableGrid()
    parser.feed(html_text)
    return [row for row in parser.rows if row]


def html_to_otsl(html_text: str) -> str:
    """Convert an HTML table into OTSL, the output format of MinerU2.5's table step.

    Spanned positions become ``<lcel>`` (same row), ``<ucel>`` (first column of the span, rows
    below) or ``<xcel>`` (the rest); rows end with ``<nl>``; ragged rows are padded with ``<ecel>``.
    """
    rows = html_table_cells(html_text)
    grid: dict[tuple[int, int], str] = {}
    for r, row in enumerate(rows):
        c = 0
        for rowspan, colspan, text in row:
            while (r, c) in grid:
                c += 1
            for dr in range(rowspan):
                for dc in range(colspan):
                    if dr == 0 and dc == 0:
                        token = f"<fcel>{text}" if text else "<ecel>"
                    else:
                        token = "<lcel>" if dr == 0 else ("<ucel>" if dc == 0 else "<xcel>")
                    grid.setdefault((r + dr, c + dc), token)
            c += colspan
    n_rows = max((r for r, _ in grid), default=-1) + 1
    n_cols = max((c for _, c in grid), default=-1) + 1
    return "".join("".join(grid.get((r, c), "<ecel>") for c in range(n_cols)) + "<nl>" for r in range(n_rows))


# OmniDocBench category -> MinerU2.5 block type (None: not a block MinerU2.5 reports).
OMNIDOCBENCH_TYPES: dict[str, str | None] = {
    "title": "title",
    "text_block": "text",
    "equation_isolated": "equation",
    "equation_caption": "text",
    "figure": "image",
    "figure_caption": "image_caption",
    "figure_footnote": "image_footnote",
    "table": "table",
    "table_caption": "table_caption",
    "table_footnote": "table_footnote",
    "code_txt": "code",
    "code_txt_caption": "code_caption",
    "reference": "ref_text",
    "header": "header",
    "footer": "footer",
    "page_number": "page_number",
    "page_footnote": "page_footnote",
    "abandon": None,
    "text_mask": None,
    "table_mask": None,
    "need_mask": None,
}
_ROTATE_BY_ATTRIBUTE = {"rotate90": "<|rotate_right|>", "rotate180": "<|rotate_down|>", "rotate270": "<|rotate_left|>"}


def _box_1000(poly: list[float], width: int, height: int) -> tuple[int, int, int, int]:
    xs, ys = poly[0::2], poly[1::2]
    x1, x2 = (min(max(round(v / width * 1000), 0), 1000) for v in (min(xs), max(xs)))
    y1, y2 = (min(max(round(v / height * 1000), 0), 1000) for v in (min(ys), max(ys)))
    if x2 <= x1:
        x1, x2 = (x1 - 1, x1) if x1 > 0 else (0, 1)
    if y2 <= y1:
        y1, y2 = (y1 - 1, y1) if y1 > 0 else (0, 1)
    return x1, y1, x2, y2


_NOT_READ = frozenset({"image", "list", "equation_block"})
_DISPLAY_DOLLARS_RE = re.compile(r"\$\$(.+?)\$\$", re.DOTALL)
# An inline "$...$" whose opening dollar is not an amount of money ("$10 or $20").
_INLINE_DOLLARS_RE = re.compile(r"(?<!\\)\$(?!\d[\d,.]*(?:[\s,.;:!?)]|$))([^$]+?)(?<!\\)\$")


def model_math(text: str) -> str:
    """Dollar-delimited math as MinerU2.5 writes it in text: ``$$..$$`` -> ``\\[..\\]``,
    ``$..$`` -> ``\\(..\\)``. An escaped ``\\$`` and a dollar before an amount (``$10``) stay."""
    text = _DISPLAY_DOLLARS_RE.sub(lambda m: f"\\[{m.group(1)}\\]", text)
    return _INLINE_DOLLARS_RE.sub(lambda m: f"\\({m.group(1)}\\)", text)


def _content(block_type: str, det: dict) -> str | None:
    if block_type in _NOT_READ:
        return None
    if block_type == "table":
        return html_to_otsl(model_math(det.get("html") or ""))
    if block_type == "equation":
        latex = (det.get("latex") or "").strip()
        latex = latex[2:-2].strip() if latex.startswith("$$") and latex.endswith("$$") else latex
        return f"\\[\n{latex}\n\\]"
    return model_math(det.get("text") or "")


def _reading_key(det: dict, height: int) -> tuple[float, float]:
    """Annotated order first; unordered paratext goes first if in the top half, else last."""
    if det.get("order") is not None:
        return (float(det["order"]), 0.0)
    top = min(det["poly"][1::2])
    return (-1.0 if top < height / 2 else float("inf"), top)


def page_trace_from_omnidocbench(page: dict, width: int, height: int) -> PageTrace:
    """One OmniDocBench page annotation -> the layout and content outputs MinerU2.5 would give.

    Boxes are scaled from the image's pixel size to 0..1000 (``page_info`` sizes are unreliable),
    categories mapped with ``OMNIDOCBENCH_TYPES``, tables converted HTML -> OTSL, isolated
    equations wrapped in ``\\[ \\]`` and inline math in text and table cells written ``\\( \\)``, as
    the model writes them.
    """
    dets = [d for d in page["layout_dets"] if OMNIDOCBENCH_TYPES.get(d["category_type"]) and not d.get("ignore")]
    dets.sort(key=lambda d: _reading_key(d, height))
    lines, contents = [], []
    for det in dets:
        block_type = OMNIDOCBENCH_TYPES[det["category_type"]]
        assert block_type is not None
        x1, y1, x2, y2 = _box_1000(det["poly"], width, height)
        rotate = _ROTATE_BY_ATTRIBUTE.get((det.get("attribute") or {}).get("text_rotate", ""), "<|rotate_up|>")
        lines.append(
            f"<|box_start|>{x1:03d} {y1:03d} {x2:03d} {y2:03d}<|box_end|><|ref_start|>{block_type}<|ref_end|>{rotate}"
        )
        contents.append(_content(block_type, det))
    return PageTrace("\n".join(lines), contents)


def build_omnidocbench_traces(annotations: str | Path, images: str | Path, out_dir: str | Path) -> list[Path]:
    """Write one trace per annotated page image: ``out_dir/<image stem>.json``.

    Args:
        annotations: OmniDocBench-format JSON (a list of ``{"page_info", "layout_dets"}``).
        images: directory holding the page images named by ``page_info.image_path``.
        out_dir: output directory (created).

    Returns:
        The written trace paths, in annotation order.

    Raises:
        TraceError: unreadable annotations or a missing image.
    """
    try:
        pages = json.loads(Path(annotations).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read annotations {annotations}: {exc}") from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for page in pages:
        image_path = Path(images) / page["page_info"]["image_path"]
        try:
            with Image.open(image_path) as im:
                width, height = im.size
        except OSError as exc:
            raise TraceError(f"cannot open page image {image_path}: {exc}") from exc
        path = out / f"{image_path.stem}.json"
        Trace([page_trace_from_omnidocbench(page, width, height)]).save(path)
        written.append(path)
    return written
