"""Tier 1: trace files and the OmniDocBench trace builder."""

from __future__ import annotations

import json

import pytest
from conftest import WORKLOAD, need

from mineru_fast.errors import TraceError
from mineru_fast.protocol.traces import OMNIDOCBENCH_TYPES, layout_lines, load_trace, page_trace_from_omnidocbench


def test_builder_maps_types_scales_boxes_and_orders_blocks():
    page = {
        "layout_dets": [
            {
                "category_type": "text_block",
                "poly": [100, 400, 900, 400, 900, 500, 100, 500],
                "order": 2,
                "text": "Body",
            },
            {"category_type": "title", "poly": [100, 100, 900, 100, 900, 200, 100, 200], "order": 1, "text": "Head"},
            {"category_type": "page_number", "poly": [500, 1900, 520, 1900, 520, 1950, 500, 1950], "text": "3"},
            {"category_type": "header", "poly": [0, 10, 1000, 10, 1000, 40, 0, 40], "text": "Journal"},
            {"category_type": "abandon", "poly": [0, 0, 10, 0, 10, 10, 0, 10]},
            {"category_type": "figure", "poly": [100, 600, 900, 600, 900, 1200, 100, 1200], "order": 3},
            {
                "category_type": "equation_isolated",
                "poly": [100, 1300, 900, 1300, 900, 1400, 100, 1400],
                "order": 4,
                "latex": "$$\nx^2\n$$",
            },
            {
                "category_type": "table",
                "poly": [100, 1500, 900, 1500, 900, 1800, 100, 1800],
                "order": 5,
                "html": '<table><tr><td colspan="2">a</td></tr><tr><td>b</td><td>c</td></tr></table>',
            },
        ]
    }
    trace = page_trace_from_omnidocbench(page, width=1000, height=2000)
    blocks = layout_lines(trace.layout)
    assert [b.type for b in blocks] == ["header", "title", "text", "image", "equation", "table", "page_number"]
    assert blocks[1].bbox == (0.1, 0.05, 0.9, 0.1)
    assert (
        trace.layout.splitlines()[1]
        == "<|box_start|>100 050 900 100<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>"
    )
    assert trace.contents == [
        "Journal",
        "Head",
        "Body",
        None,
        "\\[\nx^2\n\\]",
        "<fcel>a<lcel><nl><fcel>b<fcel>c<nl>",
        "3",
    ]


def test_workload_traces_cover_every_page(workload_traces):
    annotations = json.loads((need(WORKLOAD) / "annotations.json").read_text())
    assert len(list(workload_traces.glob("*.json"))) == len(annotations) == 14
    for page in annotations:
        trace = load_trace(workload_traces / (page["page_info"]["image_path"].rsplit(".", 1)[0] + ".json"))
        blocks = layout_lines(trace.pages[0].layout)
        kept = [d for d in page["layout_dets"] if OMNIDOCBENCH_TYPES.get(d["category_type"]) and not d.get("ignore")]
        assert len(blocks) == len(kept)
        for block, content in zip(blocks, trace.pages[0].contents, strict=True):
            assert (content is None) == (block.type == "image")


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", '{"pages": [{"layout": 3}]}', '{"pages": [{"layout": "", "contents": [1]}]}'],
)
def test_malformed_traces_raise_trace_error(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TraceError):
        load_trace(path)
