"""PP-DocLayoutV2 post-processing, block conversion and layout traces (pure, no model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mineru_fast.errors import TraceError
from mineru_fast.layout import (
    BLOCK_TYPE_BY_LABEL,
    LABELS,
    Detection,
    LayoutBlock,
    postprocess,
    select_rows,
    to_page_layout,
)
from mineru_fast.layout.labels import CLASS_ORDER, CLASS_THRESHOLDS, LABEL_IDS
from mineru_fast.layout.postprocess import PageLayout
from mineru_fast.protocol.layout_trace import LayoutTrace, detections_from_blocks, load_layout_trace

SIZE = (1000, 1400)  # page image (width, height)


def row(label: str, score: float, box: tuple, order: float, key: float) -> list[float]:
    return [LABEL_IDS[label], score, *box, order, key]


def labels_and_boxes(regions: list[Detection]) -> list[tuple[str, tuple]]:
    return [(r.label, r.bbox) for r in regions]


def test_label_facts_are_consistent():
    assert len(LABELS) == len(CLASS_THRESHOLDS) == len(CLASS_ORDER) == 25
    assert set(BLOCK_TYPE_BY_LABEL) == set(LABELS) - {"inline_formula", "reference"}
    assert BLOCK_TYPE_BY_LABEL["figure_title"] == "caption" and BLOCK_TYPE_BY_LABEL["number"] == "page_number"


def test_select_rows_thresholds_per_query_and_orders_by_keys(caplog):
    a, b, c, d = (10, 10, 500, 100), (10, 200, 500, 300), (600, 600, 700, 700), (10, 800, 900, 900)
    rows = np.array(
        [
            row("text", 0.9, a, 2, 0.9),
            row("paragraph_title", 0.45, a, 2, 0.9),  # second class of a valid query: own threshold 0.4
            row("image", 0.45, b, 1, 0.45),  # best class under its 0.5 threshold: the query is invalid
            row("text", 0.42, b, 1, 0.45),  # ... so its text row goes too, although 0.42 >= 0.4
            row("seal", 0.45, c, 0, 0.45),  # float32 0.45 passes the 0.45 threshold, as in MinerU
            row("table", 0.8, d, 2, 0.8),  # same first key as query a, smaller second key: after it
            [25, 0.99, 0, 0, 10, 10, 3, 0.99],  # class id outside the 25 labels
        ],
        dtype=np.float32,
    )
    got = select_rows(rows)
    assert [(d.label, round(d.score, 2)) for d in got] == [
        ("seal", 0.45),
        ("text", 0.9),
        ("paragraph_title", 0.45),
        ("table", 0.8),
    ]
    assert got[1].bbox == a
    assert "unknown class" in caplog.text
    assert select_rows(np.zeros((0, 8), dtype=np.float32)) == []
    with pytest.raises(ValueError, match=r"\[N, 8\]"):
        select_rows(np.zeros((3, 6)))


def test_paddlex_filter_drops_references_tiny_boxes_and_text_inside_tables():
    regions = postprocess(
        [
            Detection("reference", 0.9, (0, 0, 100, 100)),
            Detection("text", 0.9, (10, 10, 14, 50)),  # 4 px wide
            Detection("table", 0.9, (100, 100, 600, 600)),
            Detection("text", 0.9, (110, 110, 300, 300)),  # inside the table: the smaller one goes
            Detection("image", 0.8, (100, 700, 500, 1000)),
            Detection("chart", 0.7, (120, 720, 480, 980)),  # two visual labels: both stay
        ],
        SIZE,
    )
    assert labels_and_boxes(regions) == [
        ("table", (100.0, 100.0, 600.0, 600.0)),
        ("image", (100.0, 700.0, 500.0, 1000.0)),
        ("chart", (120.0, 720.0, 480.0, 980.0)),
    ]


def test_duplicates_by_iou_keep_the_higher_score_and_boxes_become_integers():
    regions = postprocess(
        [Detection("image", 0.7, (100.2, 100, 500, 500)), Detection("chart", 0.9, (100, 100, 505.1, 500))], SIZE
    )
    assert labels_and_boxes(regions) == [("chart", (100.0, 100.0, 506.0, 500.0))]


def test_nested_formulas_merge_and_formulas_are_relabelled_by_their_parent():
    merged = postprocess(
        [
            Detection("inline_formula", 0.6, (100, 100, 400, 200)),
            Detection("inline_formula", 0.9, (150, 120, 450, 180)),
        ],
        SIZE,
    )
    # The larger box absorbs the other (union, best score); alone on the page it is a display formula.
    assert [(r.label, r.score, r.bbox) for r in merged] == [("display_formula", 0.9, (100.0, 100.0, 450.0, 200.0))]
    inline = postprocess(
        [Detection("text", 0.9, (100, 100, 900, 300)), Detection("display_formula", 0.8, (200, 150, 300, 180))], SIZE
    )
    # A display formula inside text is dropped by the overlap filter; an inline one is kept and stays inline.
    assert labels_and_boxes(inline) == [("text", (100.0, 100.0, 900.0, 300.0))]
    inline = postprocess(
        [Detection("text", 0.9, (100, 100, 900, 300)), Detection("inline_formula", 0.8, (200, 150, 300, 180))], SIZE
    )
    assert [r.label for r in inline] == ["text", "inline_formula"]


def test_page_regions_are_relabelled_from_header_footer_footnote_and_number_anchors():
    regions = postprocess(
        [
            Detection("footer", 0.9, (600, 20, 900, 60)),  # a footer in the top half is a header
            Detection("text", 0.9, (100, 30, 400, 55)),  # above the header's bottom: header
            Detection("text", 0.9, (100, 200, 900, 900)),
            Detection("footnote", 0.9, (50, 1100, 950, 1200)),
            Detection("text", 0.9, (60, 1210, 900, 1250)),  # under a footnote, covered by it: footnote
            Detection("number", 0.9, (480, 1340, 520, 1380)),  # page number in the bottom 30 %
            Detection("text", 0.9, (955, 1385, 995, 1398)),  # below the page number, beside the footnote: footer
        ],
        SIZE,
    )
    assert [r.label for r in regions] == ["header", "header", "text", "footnote", "footnote", "number", "footer"]


def test_figure_titles_inside_a_visual_body_are_dropped():
    regions = postprocess(
        [Detection("image", 0.9, (100, 100, 800, 800)), Detection("figure_title", 0.9, (200, 200, 400, 250))], SIZE
    )
    assert [r.label for r in regions] == ["image"]


def test_transformers_rules_drop_formulas_inside_headers():
    detections = [Detection("header", 0.9, (0, 0, 1000, 80)), Detection("inline_formula", 0.9, (100, 20, 200, 60))]
    assert [r.label for r in postprocess(detections, SIZE, rules="onnx")] == ["header", "header"]
    assert [r.label for r in postprocess(detections, SIZE, rules="torch")] == ["header"]
    with pytest.raises(ValueError, match="rules"):
        postprocess(detections, SIZE, rules="paddle")


def test_to_page_layout_maps_labels_normalizes_and_keeps_inline_formulas_apart():
    regions = [
        Detection("text", 0.91, (100, 140, 500, 280)),
        Detection("inline_formula", 0.8, (10, 10, 50, 20)),
        Detection("seal", 0.7, (0, 0, 100, 100)),
        Detection("reference", 0.9, (0, 0, 10, 10)),  # no block type
        Detection("table", 0.9, (500, 500, 500.4, 600)),  # zero width at 3 decimals
    ]
    layout = to_page_layout(regions, SIZE, regions[:1])
    assert layout.blocks == [
        LayoutBlock("text", (0.1, 0.1, 0.5, 0.2), 0, None, None, 0.91),
        LayoutBlock("image", (0.0, 0.0, 0.1, 0.071), 0, None, "seal", 0.7),
    ]
    assert layout.inline_formulas == [(0.01, 0.007, 0.05, 0.014)]
    assert layout.detections == regions[:1] and layout.image_size == SIZE


def test_layout_trace_round_trip_and_recording(tmp_path):
    layout = PageLayout([], [], [Detection("text", 0.5, (100.0, 140.0, 500.0, 700.0))], SIZE)
    trace = LayoutTrace.from_layouts([layout, PageLayout([], image_size=SIZE)])
    assert trace.pages == [[Detection("text", 0.5, (0.1, 0.1, 0.5, 0.5))], []]
    path = tmp_path / "layout.json"
    trace.save(path)
    assert json.loads(path.read_text())["layout_model"] == "PP-DocLayoutV2"
    assert load_layout_trace(path) == trace


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "'pages' list"),
        ({"layout_model": "DocLayout-YOLO", "pages": []}, "not PP-DocLayoutV2"),
        ({"pages": [{}]}, "'detections' list"),
        ({"pages": [{"detections": [{"label": "figure", "score": 1, "bbox": [0, 0, 1, 1]}]}]}, "unknown label"),
        ({"pages": [{"detections": [{"label": "text", "score": 1.5, "bbox": [0, 0, 1, 1]}]}]}, "score"),
        ({"pages": [{"detections": [{"label": "text", "score": 1, "bbox": [0, 0, 1]}]}]}, "bbox"),
        ({"pages": [{"detections": [{"label": "text", "score": 1, "bbox": [0, 0, "1", 1]}]}]}, "bbox"),
    ],
)
def test_layout_trace_rejects_bad_structure(data, message):
    with pytest.raises(TraceError, match=message):
        LayoutTrace.from_dict(data)


def test_unreadable_layout_trace_is_a_trace_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(TraceError, match="cannot read"):
        load_layout_trace(path)


def test_vlm_blocks_become_replayable_detections():
    got = detections_from_blocks([("title", [0.1, 0.1, 0.9, 0.2]), ("table_caption", (0.1, 0.3, 0.5, 0.35))])
    assert got == [
        Detection("paragraph_title", 1.0, (0.1, 0.1, 0.9, 0.2)),
        Detection("figure_title", 1.0, (0.1, 0.3, 0.5, 0.35)),
    ]
    with pytest.raises(TraceError, match="unknown"):
        detections_from_blocks([("unknown", (0, 0, 1, 1))])
