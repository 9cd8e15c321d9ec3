"""PP-DocLayoutV2 detections -> a page's layout, as MinerU 4.0.12 post-processes them.

Pure numpy/Python (no torch, no model). The steps and their thresholds are MinerU 4.0.12's
(``mineru/model/layout/pp_doclayout_v2_base.py``, ``pp_doclayout_v2_onnx.py`` and the
transformers variant ``pp_doclayoutv2.py``; ``backend/analysis/pdf/layout.py`` for the block
conversion):

1. ``select_rows``: from the detector's rows ``[class, score, x0, y0, x1, y1, order_a, order_b]``,
   keep a query only if its best class passes that class's threshold, then each of its rows
   that passes its own class threshold; order by ``order_a`` ascending, ``order_b`` descending.
2. ``postprocess``: integer boxes clipped to the page; PaddleX's filter (references dropped,
   boxes under 6 px dropped, of two boxes overlapping > 0.7 of the smaller the smaller dropped
   unless both are visual or neither is a table); duplicates (IoU > 0.9) removed; nested formula
   boxes (overlap >= 0.7) merged; formulas inside a non-formula box (cover >= 0.7) relabelled
   ``inline_formula``, others ``display_formula``; header/footer anchors corrected by page half
   and used to relabel boundary blocks, blocks under a footnote relabelled ``footnote``, page
   numbers in the top/bottom 30 % used as extra boundaries; figure titles inside a visual body
   (cover >= 0.8) dropped. ``rules="torch"`` adds the two rules only MinerU's transformers backend
   has (formulas inside headers/footers dropped; formulas never relabelled as header/footer);
   MinerU runs the ONNX rules on CPU.
3. ``to_page_layout``: labels -> block types (``labels.BLOCK_TYPE_BY_LABEL``), boxes normalized to
   0..1 with 3 decimals; ``inline_formula`` boxes are kept apart (they are not blocks: MinerU
   recognizes them separately and splices them into the text that holds them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mineru_fast.layout.labels import BLOCK_TYPE_BY_LABEL, CLASS_THRESHOLDS, LABELS

logger = logging.getLogger(__name__)

__all__ = [
    "Detection",
    "LayoutBlock",
    "PageLayout",
    "select_rows",
    "postprocess",
    "to_page_layout",
    "RULES",
]

RULES = ("onnx", "torch")
Box = tuple[float, float, float, float]

_VISUAL = frozenset({"image", "chart", "table", "seal"})
_FORMULAS = frozenset({"display_formula", "inline_formula"})
_HEADERS = frozenset({"header", "header_image"})
_FOOTERS = frozenset({"footer", "footer_image"})
_BOUNDARY_EXEMPT = frozenset({"aside_text", "footnote", "number"})
_PAGE_REGIONS = _HEADERS | _FOOTERS | {"footnote", "number", "aside_text"}


@dataclass(frozen=True)
class Detection:
    """One detected region.

    Attributes:
        label: one of ``labels.LABELS``.
        score: sigmoid class score in [0, 1].
        bbox: ``(x0, y0, x1, y1)`` in pixels of the page image the detector saw (floats from the
            model; integers after ``postprocess``).
    """

    label: str
    score: float
    bbox: Box


@dataclass(frozen=True)
class LayoutBlock:
    """A block of a page, in reading order.

    Attributes:
        type: MinerU block type (``"text"``, ``"table"``, ``"caption"``, ...).
        bbox: ``(x0, y0, x1, y1)`` normalized to the page, 0..1.
        angle: the content's rotation in degrees (0, 90, 180, 270), mineru-vl-utils' convention
            (its crop is turned with ``PIL.Image.rotate(angle, expand=True)``).
        content: text filled in later (from the PDF or the VLM); None until then.
        sub_type: ``"seal"`` for seals (typed ``image``), else None.
        score: the detector's score, None for blocks not from a detector.
    """

    type: str
    bbox: Box
    angle: int = 0
    content: str | None = None
    sub_type: str | None = None
    score: float | None = None


@dataclass
class PageLayout:
    """The layout of one page.

    Attributes:
        blocks: blocks in reading order.
        inline_formulas: normalized boxes of the ``inline_formula`` regions, in reading order.
        detections: the detector's regions before ``postprocess`` (what a replay trace records).
        image_size: ``(width, height)`` of the page image the detector saw, pixels.
    """

    blocks: list[LayoutBlock]
    inline_formulas: list[Box] = field(default_factory=list)
    detections: list[Detection] = field(default_factory=list)
    image_size: tuple[int, int] = (0, 0)


def select_rows(rows: np.ndarray) -> list[Detection]:
    """Threshold and order one page's detector rows.

    Args:
        rows: float array ``[N, 8]``: class id, score, x0, y0, x1, y1 (page pixels), two
            reading-order keys. Rows of one query share columns 2..7 (a query may appear once per
            class that scored high).

    Returns:
        The detections that pass, in reading order. Class ids outside ``LABELS`` are dropped with
        a warning.

    Raises:
        ValueError: ``rows`` is not ``[N, 8]``.
    """
    rows = np.asarray(rows)
    if not np.issubdtype(rows.dtype, np.floating):
        rows = rows.astype(np.float32)
    if rows.ndim != 2 or rows.shape[1] != 8:
        raise ValueError(f"detector rows must have shape [N, 8], got {rows.shape}")
    known = np.isfinite(rows).all(axis=1) & (rows[:, 0] >= 0) & (rows[:, 0] < len(LABELS))
    known &= rows[:, 0] == np.round(rows[:, 0])
    if not known.all():
        logger.warning("dropped %d detector rows with an unknown class or non-finite values", int((~known).sum()))
        rows = rows[known]
    if len(rows) == 0:
        return []
    labels = rows[:, 0].astype(np.int64)
    scores = rows[:, 1]
    # Compared in the rows' own dtype, as MinerU does (a float32 0.45 passes a 0.45 threshold).
    thresholds = np.asarray(CLASS_THRESHOLDS, dtype=rows.dtype)[labels]
    _, query = np.unique(rows[:, 2:8], axis=0, return_inverse=True)
    query = query.reshape(-1)
    # A query's primary class: its highest score, ties to the lower class id (argmax's rule).
    order = np.lexsort((labels, -scores, query))
    first = np.ones(len(order), dtype=bool)
    first[1:] = query[order][1:] != query[order][:-1]
    primary = order[first]
    valid_query = np.zeros(query.max() + 1, dtype=bool)
    valid_query[query[primary]] = scores[primary] >= thresholds[primary]
    keep = valid_query[query] & (scores >= thresholds)
    kept = rows[keep]
    kept = kept[np.lexsort((-kept[:, 7], kept[:, 6]))]
    return [Detection(LABELS[int(r[0])], float(r[1]), as_box(r[2:6])) for r in kept]


# -- geometry ---------------------------------------------------------------------------------


def _area(b: Sequence[float]) -> float:
    return max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])


def _inter(a: Sequence[float], b: Sequence[float]) -> float:
    return _area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))


def _overlap_of_smaller(a: Sequence[float], b: Sequence[float]) -> float:
    smaller = min(_area(a), _area(b))
    return _inter(a, b) / smaller if smaller > 0 else 0.0


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    inter = _inter(a, b)
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def _cover(inner: Sequence[float], outer: Sequence[float]) -> float:
    """Share of ``inner``'s area that lies inside ``outer``."""
    area = _area(inner)
    return _inter(inner, outer) / area if area > 0 else 0.0


def _x_overlap_of_narrower(a: Sequence[float], b: Sequence[float]) -> float:
    narrower = min(max(0.0, a[2] - a[0]), max(0.0, b[2] - b[0]))
    if narrower <= 0:
        return 0.0
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) / narrower


def _x_cover(anchor: Sequence[float], candidate: Sequence[float]) -> float:
    """Share of ``candidate``'s width that lies under ``anchor``."""
    width = max(0.0, candidate[2] - candidate[0])
    if width <= 0:
        return 0.0
    return max(0.0, min(anchor[2], candidate[2]) - max(anchor[0], candidate[0])) / width


def _int_box(bbox: Sequence[float], width: int, height: int) -> list[int] | None:
    """Floor/ceil to integers, clamp to the page; None when empty."""
    x0 = min(max(math.floor(bbox[0]), 0), width)
    y0 = min(max(math.floor(bbox[1]), 0), height)
    x1 = min(max(math.ceil(bbox[2]), 0), width)
    y1 = min(max(math.ceil(bbox[3]), 0), height)
    return [x0, y0, x1, y1] if x1 > x0 and y1 > y0 else None


# -- post-processing --------------------------------------------------------------------------


@dataclass
class _Box:
    label: str
    score: float
    bbox: list[int]


def _paddlex_filter(boxes: list[_Box]) -> list[_Box]:
    """PaddleX's overlap filter as MinerU calls it (inline formulas exempt)."""
    boxes = [b for b in boxes if b.label != "reference"]
    dropped: set[int] = set()
    for i, a in enumerate(boxes):
        if i in dropped:
            continue
        if a.label != "inline_formula" and (a.bbox[2] - a.bbox[0] < 6 or a.bbox[3] - a.bbox[1] < 6):
            dropped.add(i)
            continue
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            if i in dropped or j in dropped or "inline_formula" in (a.label, b.label):
                continue
            if _overlap_of_smaller(a.bbox, b.bbox) <= 0.7:
                continue
            labels = {a.label, b.label}
            if labels & _VISUAL and len(labels) > 1 and ("table" not in labels or labels <= _VISUAL):
                continue
            dropped.add(j if _area(a.bbox) >= _area(b.bbox) else i)
    return [b for i, b in enumerate(boxes) if i not in dropped]


def _deduplicate(boxes: list[_Box], iou_threshold: float = 0.9) -> list[_Box]:
    by_score = sorted(range(len(boxes)), key=lambda i: (-boxes[i].score, i))
    suppressed: set[int] = set()
    for pos, i in enumerate(by_score):
        if i in suppressed:
            continue
        for j in by_score[pos + 1 :]:
            if j not in suppressed and _iou(boxes[i].bbox, boxes[j].bbox) > iou_threshold:
                suppressed.add(j)
    return [b for i, b in enumerate(boxes) if i not in suppressed]


def _merge_nested_formulas(boxes: list[_Box], overlap_threshold: float = 0.7) -> list[_Box]:
    boxes = list(boxes)
    merged = True
    while merged:
        merged = False
        formulas = [i for i, b in enumerate(boxes) if b.label in _FORMULAS]
        for pos, i in enumerate(formulas):
            for j in formulas[pos + 1 :]:
                a, b = boxes[i], boxes[j]
                if _overlap_of_smaller(a.bbox, b.bbox) < overlap_threshold:
                    continue
                area_a, area_b = _area(a.bbox), _area(b.bbox)
                keep_i = area_a > area_b or (area_a == area_b and a.score >= b.score)
                keep, drop = (i, j) if keep_i else (j, i)
                kb, db = boxes[keep], boxes[drop]
                kb.bbox = [
                    math.floor(min(kb.bbox[0], db.bbox[0])),
                    math.floor(min(kb.bbox[1], db.bbox[1])),
                    math.ceil(max(kb.bbox[2], db.bbox[2])),
                    math.ceil(max(kb.bbox[3], db.bbox[3])),
                ]
                kb.score = round(max(kb.score, db.score), 4)
                del boxes[drop]
                merged = True
                break
            if merged:
                break
    return boxes


def _relabel_formulas(boxes: list[_Box], cover_threshold: float = 0.7) -> None:
    parents = [b for b in boxes if b.label not in _FORMULAS | {"formula_number", "reference"}]
    for box in boxes:
        if box.label in _FORMULAS:
            inside = any(_cover(box.bbox, p.bbox) >= cover_threshold for p in parents)
            box.label = "inline_formula" if inside else "display_formula"


def _drop_formulas_in_marginals(boxes: list[_Box], cover_threshold: float = 0.8) -> list[_Box]:
    marginals = [b for b in boxes if b.label in _HEADERS | _FOOTERS]
    return [
        b
        for b in boxes
        if b.label not in _FORMULAS or not any(_cover(b.bbox, m.bbox) >= cover_threshold for m in marginals)
    ]


def _relabel_page_regions(boxes: list[_Box], height: int, width: int, formulas_exempt: bool) -> None:
    """Header/footer/footnote corrections at the page's margins (list order = reading order)."""
    if len(boxes) <= 1:
        return

    def candidate(box: _Box, anchor_labels: frozenset[str]) -> bool:
        if formulas_exempt and box.label in _FORMULAS:
            return False
        return box.label not in _BOUNDARY_EXEMPT and box.label not in anchor_labels

    middle = height * 0.5
    for box in boxes:
        y_mid = (box.bbox[1] + box.bbox[3]) / 2
        if y_mid < middle and box.label in _FOOTERS:
            box.label = box.label.replace("footer", "header")
        elif y_mid >= middle and box.label in _HEADERS:
            box.label = box.label.replace("header", "footer")
    anchors = {id(b) for b in boxes if b.label in _HEADERS | _FOOTERS}
    index = {id(b): i for i, b in enumerate(boxes)}
    headers = [b for b in boxes if b.label in _HEADERS]
    footers = [b for b in boxes if b.label in _FOOTERS]
    header = max(headers, key=lambda b: (b.bbox[3], index[id(b)]), default=None)
    footer = min(footers, key=lambda b: (b.bbox[1], index[id(b)]), default=None)

    if header is not None:
        for box in boxes:
            if candidate(box, _HEADERS) and box.bbox[3] <= header.bbox[3]:
                box.label = "header"
    footnotes = [b for b in boxes if b.label == "footnote"]
    for box in boxes:
        if box.label in _PAGE_REGIONS:
            continue
        if any(box.bbox[1] >= f.bbox[1] and _x_cover(f.bbox, box.bbox) >= 0.7 for f in footnotes):
            box.label = "footnote"
    if footer is not None:
        full_width = width > 0 and (footer.bbox[2] - footer.bbox[0]) / width >= 0.7
        for box in boxes:
            in_scope = full_width or _x_overlap_of_narrower(footer.bbox, box.bbox) >= 0.3
            if candidate(box, _FOOTERS) and box.bbox[1] >= footer.bbox[1] and in_scope:
                box.label = "footer"

    if height <= 0:
        return
    numbers = [b for b in boxes if b.label == "number"]
    top = [b for b in numbers if (b.bbox[1] + b.bbox[3]) / 2 <= height * 0.3]
    bottom = [b for b in numbers if (b.bbox[1] + b.bbox[3]) / 2 >= height * 0.7]
    top_number = max(top, key=lambda b: (b.bbox[3], index[id(b)]), default=None)
    bottom_number = min(bottom, key=lambda b: (b.bbox[1], index[id(b)]), default=None)
    no_anchor: frozenset[str] = frozenset()
    if top_number is not None:
        for box in boxes:
            if id(box) not in anchors and candidate(box, no_anchor) and box.bbox[3] <= top_number.bbox[1]:
                box.label = "header"
    if bottom_number is not None:
        for box in boxes:
            if id(box) not in anchors and candidate(box, no_anchor) and box.bbox[1] >= bottom_number.bbox[3]:
                box.label = "footer"


def _drop_internal_captions(boxes: list[_Box], cover_threshold: float = 0.8) -> list[_Box]:
    visuals = [b for b in boxes if b.label in _VISUAL]

    def internal(box: _Box) -> bool:
        cx, cy = (box.bbox[0] + box.bbox[2]) / 2, (box.bbox[1] + box.bbox[3]) / 2
        centered = [v for v in visuals if v.bbox[0] <= cx <= v.bbox[2] and v.bbox[1] <= cy <= v.bbox[3]]
        return any(_cover(box.bbox, v.bbox) >= cover_threshold for v in centered)

    return [b for b in boxes if b.label != "figure_title" or not internal(b)]


def postprocess(detections: Sequence[Detection], image_size: tuple[int, int], rules: str = "onnx") -> list[Detection]:
    """MinerU 4.0.12's post-processing of one page's detections (see the module docstring).

    Args:
        detections: ``select_rows`` output (or a replayed trace), in reading order.
        image_size: ``(width, height)`` of the page image in pixels.
        rules: ``"onnx"`` (MinerU's CPU backend) or ``"torch"`` (its transformers backend).

    Returns:
        The page's regions in reading order, with integer pixel boxes.

    Raises:
        ValueError: unknown ``rules``.
    """
    if rules not in RULES:
        raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
    width, height = image_size
    boxes = [
        _Box(d.label, round(d.score, 4), box)
        for d in detections
        if (box := _int_box(d.bbox, width, height)) is not None
    ]
    boxes = _paddlex_filter(boxes)
    boxes = _deduplicate(boxes)
    boxes = _merge_nested_formulas(boxes)
    _relabel_formulas(boxes)
    if rules == "torch":
        boxes = _drop_formulas_in_marginals(boxes)
    _relabel_page_regions(boxes, height, width, formulas_exempt=rules == "torch")
    boxes = _drop_internal_captions(boxes)
    return [Detection(b.label, b.score, as_box(b.bbox)) for b in boxes]


def as_box(values: Sequence[float]) -> Box:
    """The first four values as a float ``(x0, y0, x1, y1)``."""
    return (float(values[0]), float(values[1]), float(values[2]), float(values[3]))


def scale_box(bbox: Sequence[float], sx: float, sy: float) -> Box:
    """``bbox`` with x multiplied by ``sx`` and y by ``sy``."""
    return (bbox[0] * sx, bbox[1] * sy, bbox[2] * sx, bbox[3] * sy)


def _normalized(bbox: Box, width: int, height: int) -> Box | None:
    x0, y0, x1, y1 = (
        round(min(max(bbox[0] / width, 0.0), 1.0), 3),
        round(min(max(bbox[1] / height, 0.0), 1.0), 3),
        round(min(max(bbox[2] / width, 0.0), 1.0), 3),
        round(min(max(bbox[3] / height, 0.0), 1.0), 3),
    )
    return (x0, y0, x1, y1) if x1 > x0 and y1 > y0 else None


def to_page_layout(
    regions: Sequence[Detection], image_size: tuple[int, int], detections: Sequence[Detection] = ()
) -> PageLayout:
    """Post-processed regions -> blocks (MinerU's label -> type map) and inline-formula boxes.

    Args:
        regions: ``postprocess`` output (pixel boxes), in reading order.
        image_size: ``(width, height)`` of the page image in pixels.
        detections: the raw detections, kept on the result for tracing.

    Returns:
        The page layout; regions whose label maps to no block type, and boxes that vanish when
        normalized to 3 decimals, produce nothing.
    """
    width, height = image_size
    blocks: list[LayoutBlock] = []
    formulas: list[Box] = []
    for region in regions:
        bbox = _normalized(region.bbox, width, height)
        if bbox is None:
            continue
        if region.label == "inline_formula":
            formulas.append(bbox)
            continue
        block_type = BLOCK_TYPE_BY_LABEL.get(region.label)
        if block_type is None:
            continue
        sub_type = "seal" if region.label == "seal" else None
        blocks.append(LayoutBlock(block_type, bbox, 0, None, sub_type, region.score))
    return PageLayout(blocks, formulas, list(detections), (width, height))
