"""Tier 1: the per-page protocol (mineru-vl-utils 2.0.x rules) and the MinerU 4 writer, pinned with
small raw model strings (no model, no official mineru package)."""

from __future__ import annotations

from PIL import Image

from mineru_fast.protocol.page import RAW_TYPE_KEY, ContentOutput, plan_content, read_layout
from mineru_fast.protocol.traces import PageTrace, model_math
from mineru_fast.results.finish import finish_blocks
from mineru_fast.results.page import Block, Page
from mineru_fast.results.table_markdown import render_table
from mineru_fast.results.writer import render_page


def line(box: str, kind: str, tail: str = "<|rotate_up|>") -> str:
    return f"<|box_start|>{box}<|box_end|><|ref_start|>{kind}<|ref_end|>{tail}"


PAGE = Image.new("RGB", (1000, 1000), "white")


def run(layout: str, contents: dict[str, str], *, image_analysis: bool = False) -> tuple[list[Block], PageTrace]:
    """Replay ``contents`` (by layout line type) through the three protocol functions."""
    lines = layout.split("\n")
    trace = PageTrace(layout, [contents.get(ln.split("<|ref_start|>")[1].split("<")[0]) for ln in lines])
    page_layout = read_layout(layout)
    requests = plan_content(PAGE, page_layout, image_analysis=image_analysis)
    outputs = {
        r.block_index: ContentOutput(trace.content_for(page_layout.blocks[r.block_index]) or "") for r in requests
    }
    return finish_blocks(page_layout, outputs), trace


def markdown(blocks: list[Block]) -> str:
    return render_page(Page(0, PAGE.size, blocks)).markdown


def items(blocks: list[Block]) -> list[dict]:
    return render_page(Page(0, PAGE.size, blocks)).content_list


def test_layout_grammar_angles_merge_prev_and_invalid_boxes():
    layout = "\n".join(
        [
            line("010 020 500 080", "title"),
            line("010 100 990 400", "text", "<|rotate_right|>txt_contd_tgt"),
            line("600 200 100 100", "text", ""),  # inverted corners are swapped, no angle
            line("100 100 100 300", "text"),  # empty box: dropped
            line("100 100 1200 300", "text"),  # out of range: dropped
        ]
    )
    blocks = read_layout(layout).blocks
    assert [(b["type"], b["bbox"], b["angle"]) for b in blocks] == [
        ("title", [0.01, 0.02, 0.5, 0.08], 0),
        ("text", [0.01, 0.1, 0.99, 0.4], 90),
        ("text", [0.1, 0.1, 0.6, 0.2], None),
    ]
    assert blocks[1]["merge_prev"] is True and blocks[2]["merge_prev"] is False


def test_unknown_type_is_kept_as_text_with_its_raw_type_and_a_warning():
    layout = "\n".join([line("100 100 900 200", "text"), line("100 300 900 400", "sidebar_quote")])
    page_layout = read_layout(layout)
    assert [b["type"] for b in page_layout.blocks] == ["text", "text"]
    assert page_layout.blocks[1][RAW_TYPE_KEY] == "sidebar_quote" and page_layout.unknown_types == ["sidebar_quote"]
    assert page_layout.warnings == ["layout block type 'sidebar_quote' is unknown to the protocol; kept as text"]
    blocks, _ = run(layout, {"text": "Body.", "sidebar_quote": "A quote."})
    assert [(b.type, b.raw_type, b.content) for b in blocks] == [
        ("text", None, "Body."),
        ("text", "sidebar_quote", "A quote."),
    ]
    assert markdown(blocks) == "Body.\n\nA quote."


def test_unknown_layout_type_is_read_as_image_and_inline_formula_lines_skipped():
    layout = "\n".join([line("100 100 900 400", "unknown"), line("100 500 300 520", "inline_formula")])
    assert [b["type"] for b in read_layout(layout).blocks] == ["image"]
    assert read_layout("no layout here").warnings == ["layout output has no valid block (14 characters)"]


def test_duplicates_and_text_inside_tables_are_filtered():
    layout = "\n".join(
        [
            line("100 100 900 500", "table"),
            line("101 101 900 500", "table"),  # IoU > 0.9 with the first: dropped
            line("150 150 400 200", "text"),  # inside the table: dropped
            line("100 600 900 700", "text"),
        ]
    )
    assert [(b["type"], b["bbox"][1]) for b in read_layout(layout).blocks] == [("table", 0.1), ("text", 0.6)]


def test_what_is_read_and_with_which_prompt():
    layout = "\n".join(
        [
            line("100 050 900 090", "title"),
            line("100 100 900 300", "table"),
            line("100 350 900 400", "equation"),
            line("100 450 900 800", "image"),
            line("100 810 900 830", "image_caption"),
            line("100 850 900 950", "list"),
            line("100 850 900 900", "list_item"),
        ]
    )
    page_layout = read_layout(layout)
    off = [
        (page_layout.blocks[r.block_index]["type"], r.task, r.prompt)
        for r in plan_content(PAGE, page_layout, image_analysis=False)
    ]
    assert off == [
        ("title", "text", "\nText Recognition:"),
        ("table", "table", "\nTable Recognition:"),
        ("equation", "equation", "\nFormula Recognition:"),
        ("image_caption", "text", "\nText Recognition:"),
        ("list_item", "text", "\nText Recognition:"),
    ]
    on = plan_content(PAGE, read_layout(layout), image_analysis=True)
    assert [(r.task, r.prompt) for r in on if r.task == "image"] == [("image", "\nImage Analysis:")]


def test_rotated_block_crop_is_rotated_and_small_crops_are_upscaled():
    page = Image.new("RGB", (1000, 1000), "white")
    layout = line("100 100 200 400", "text", "<|rotate_left|>") + "\n" + line("100 500 105 505", "text")
    requests = plan_content(page, read_layout(layout), image_analysis=False)
    assert requests[0].image.size == (300, 100)  # 100x300 crop rotated by 270 degrees
    assert min(requests[1].image.size) == 28


def test_equation_block_merges_its_equations_and_tags():
    layout = "\n".join(
        [
            line("100 100 900 300", "equation_block"),
            line("110 110 890 190", "equation"),
            line("110 200 890 290", "equation"),
        ]
    )
    trace = PageTrace(layout, [None, "\\[a=b \\tag{1}\\]", "\\[c=d \\tag{2}\\]"])
    page_layout = read_layout(layout)
    requests = plan_content(PAGE, page_layout, image_analysis=False)
    outputs = {r.block_index: ContentOutput(trace.content_for(page_layout.blocks[r.block_index])) for r in requests}
    blocks = finish_blocks(page_layout, outputs)
    assert [(b.type, b.content) for b in blocks] == [
        ("equation", "\\[\n\\begin{array}{l} a=b (1) \\\\ c=d (2) \\\\ \\end{array}\n\\]")
    ]
    assert markdown(blocks) == "$$\n\\begin{array}{l} a=b (1) \\\\ c=d (2) \\\\ \\end{array}\n$$"
    (item,) = items(blocks)
    assert item["type"] == "equation" and item["text"].startswith("\\begin{array}") and item["text_format"] == "latex"


def test_non_text_placeholder_is_dropped_but_header_kept_empty():
    layout = "\n".join([line("100 010 900 040", "header"), line("100 100 900 200", "text")])
    blocks, _ = run(layout, {"header": "[Non-Text]", "text": "[Non-Text]"})
    assert [(b.type, b.content) for b in blocks] == [("header", "")]
    assert markdown(blocks) == "" and items(blocks)[0] == {
        "type": "header",
        "text": "",
        "bbox": [100, 10, 900, 40],
        "page_idx": 0,
    }


def test_inline_math_escaping_and_halfwidth_in_text():
    layout = line("100 100 900 200", "text")
    blocks, _ = run(layout, {"text": "# not a heading *x* costs $5; area \\(a_1 \\times b\\) ＡＢ１２：done"})
    assert markdown(blocks) == "\\# not a heading \\*x\\* costs \\$5; area $a_1 \\times b$ AB12:done"
    assert items(blocks)[0]["text"] == "# not a heading \\*x\\* costs \\$5; area $a_1 \\times b$ AB12:done"


def test_titles_are_level_2_headings_and_doc_titles_level_1():
    layout = "\n".join([line("100 050 900 090", "doc_title"), line("100 100 900 150", "title")])
    blocks, _ = run(layout, {"doc_title": "Paper", "title": "1 Intro\nduction"})
    assert markdown(blocks) == "# Paper\n\n## 1 Intro duction"
    assert [i["text_level"] for i in items(blocks)] == [1, 2]


def test_simple_tables_become_pipe_tables_and_spanning_ones_stay_html():
    assert render_table("<table><tr><td>a|b</td><td>c</td></tr><tr><td>1</td><td>2</td></tr></table>") == (
        "| a\\|b | c |\n| --- | --- |\n| 1 | 2 |"
    )
    merged = '<table><tr><td colspan="2">h</td></tr><tr><td><eq>x</eq></td><td>2</td></tr></table>'
    assert render_table(merged) == '<table><tr><td colspan="2">h</td></tr><tr><td> $x$ </td><td>2</td></tr></table>'
    layout = line("100 100 900 500", "table")
    blocks, _ = run(layout, {"table": "<fcel>a<fcel>\\(x^2\\)<nl><fcel>1<fcel>2<nl>"})
    assert markdown(blocks) == "| a | $x^2$ |\n| --- | --- |\n| 1 | 2 |"
    assert (
        items(blocks)[0]["table_body"]
        == "<table><tr><td>a</td><td> $x^2$ </td></tr><tr><td>1</td><td>2</td></tr></table>"
    )


def test_captions_and_footnotes_group_with_their_visual_by_order_and_geometry():
    layout = "\n".join(
        [
            line("100 100 900 400", "image"),
            line("100 410 900 430", "image_caption"),
            line("100 450 900 470", "table_caption"),
            line("100 480 900 700", "table"),
            line("100 710 900 730", "table_footnote"),
            line("100 800 900 900", "text"),
        ]
    )
    blocks, _ = run(
        layout, {"image_caption": "Fig. 1", "table_caption": "Tab. 1", "table_footnote": "n=3", "text": "After."}
    )
    out = items(blocks)
    assert [i["type"] for i in out] == ["image", "table", "text"]
    assert (out[0]["image_caption"], out[1]["table_caption"], out[1]["table_footnote"]) == (
        ["Fig. 1"],
        ["Tab. 1"],
        ["n=3"],
    )
    assert (
        markdown(blocks)
        == "![](images/page_0_image_0.jpg)\n\nFig. 1\n\nTab. 1\n\n![](images/page_0_table_3.jpg)\n\nn=3\n\nAfter."
    )


def test_list_items_and_page_footnotes():
    layout = "\n".join(
        [
            line("100 100 900 300", "list"),
            line("100 100 900 150", "text"),
            line("100 160 900 300", "text"),
            line("100 900 900 950", "page_footnote"),
            line("100 960 900 990", "page_number"),
        ]
    )
    trace = PageTrace(layout, [None, "1. one", "2. two", "* a note", "7"])
    page_layout = read_layout(layout)
    requests = plan_content(PAGE, page_layout, image_analysis=False)
    outputs = {r.block_index: ContentOutput(trace.content_for(page_layout.blocks[r.block_index])) for r in requests}
    blocks = finish_blocks(page_layout, outputs)
    out = items(blocks)
    assert out[0] == {
        "type": "list",
        "sub_type": "text",
        "list_items": ["1. one", "2. two"],
        "bbox": [100, 100, 900, 300],
        "page_idx": 0,
    }
    assert all(i["type"] != "text" or i["text"] for i in out)  # no empty text items
    assert markdown(blocks) == (
        '1. one\n2. two\n\n<small><span class="docvortex-page-footnote" data-block-type="page_footnote" '
        'style="color:#6b7280">\\* a note</span></small>'
    )


def test_formula_number_joins_its_equation_as_a_tag():
    layout = "\n".join([line("100 100 800 200", "equation"), line("850 120 900 180", "formula_number")])
    blocks, _ = run(layout, {"equation": "\\[x=1\\]", "formula_number": "(2.1)"})
    (item,) = items(blocks)
    assert item["text"] == "x=1\\tag{2.1}" and item["bbox"] == [100, 100, 900, 200]


def test_trace_builder_writes_model_math():
    assert model_math("area $x^2$ costs $5 or $10, $$y$$") == "area \\(x^2\\) costs $5 or $10, \\[y\\]"
