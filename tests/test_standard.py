"""The standard tier's page plan: text from the PDF, the rest (and inline formulas) from the VLM."""

from __future__ import annotations

import pypdfium2 as pdfium
import pytest
from samples import born_digital_pdf

from mineru_fast.inputs.pdftext import PageText, PdfChar, read_page_text
from mineru_fast.layout import LayoutBlock, PageLayout
from mineru_fast.pipeline.standard import TEXT_FROM_PDF, VlmRead, finish_page, plan_page

RUNS = [
    (72, 72, 18, "A Title"),
    (72, 110, 11, "The quick brown fox jumps over the lazy"),
    (72, 124, 11, "dog, and then E = mc"),
    (177.2, 120, 7, "2"),
    (185, 124, 11, "holds."),
    (320, 110, 11, "Right column caption"),
]
TITLE, BODY, CAPTION = (0.1, 0.06, 0.6, 0.11), (0.1, 0.12, 0.5, 0.17), (0.5, 0.12, 0.9, 0.15)
TABLE, IMAGE, EMPTY, EQUATION, LIST = (
    (0.1, 0.4, 0.9, 0.6),
    (0.1, 0.65, 0.9, 0.8),
    (0.1, 0.85, 0.9, 0.9),
    (0.1, 0.92, 0.9, 0.95),
    (0.1, 0.96, 0.9, 0.99),
)


@pytest.fixture(scope="module")
def text() -> PageText:
    return read_page_text(pdfium.PdfDocument(born_digital_pdf([RUNS]))[0])


@pytest.fixture(scope="module")
def layout(text) -> PageLayout:
    e = next(c for c in text.chars if c.text == "E")
    formula = (e.bbox[0] - 0.001, e.bbox[1] - 0.005, 0.3, e.bbox[3] + 0.001)  # "E = mc2"
    blocks = [
        LayoutBlock("doc_title", TITLE),
        LayoutBlock("text", BODY),
        LayoutBlock("caption", CAPTION),
        LayoutBlock("table", TABLE),
        LayoutBlock("image", IMAGE),
        LayoutBlock("text", EMPTY),
        LayoutBlock("equation", EQUATION),
        LayoutBlock("list", LIST),
    ]
    return PageLayout(blocks, [formula, (0.2, 0.45, 0.3, 0.5)])  # the second formula lies in the table


def test_text_like_types_are_mineru_4s():
    assert TEXT_FROM_PDF >= {"text", "doc_title", "paragraph_title", "header", "footer", "page_number"}
    assert TEXT_FROM_PDF >= {"page_footnote", "ref_text", "caption", "footnote", "table_caption", "code_caption"}
    assert not TEXT_FROM_PDF & {"table", "equation", "code", "aside_text", "index", "list", "image", "formula_number"}


def test_txt_page_fills_text_from_the_pdf_and_reads_the_rest(layout, text):
    plan = plan_page(layout, text, mode="txt")
    assert (plan.mode, plan.reason) == ("txt", "text layer passes every check")
    contents = [b.content for b in plan.blocks]
    assert contents[0] == "A Title" and contents[2] == "Right column caption"
    assert contents[1] == "The quick brown fox jumps over the lazy dog, and then \\(\x000\x00\\) holds."
    assert contents[3:] == [None] * 5
    formula = layout.inline_formulas[0]
    assert plan.reads == [
        VlmRead("table", TABLE, block=3),
        VlmRead("text", EMPTY, block=5),  # a text block with no PDF text is read from the image
        VlmRead("equation", EQUATION, block=6),
        VlmRead("equation", formula, formula=0),  # the inline formula of the body text
    ]
    assert plan.formula_text == {0: "E = mc<sup>2</sup>"}

    done = finish_page(plan, ["<table></table>", "recovered text", "x = 1", "\\[E = mc^{2}\\]"])
    assert done[1].content == "The quick brown fox jumps over the lazy dog, and then \\(E = mc^{2}\\) holds."
    assert [b.content for b in done[3:]] == ["<table></table>", None, "recovered text", "x = 1", None]
    assert [b.type for b in done] == [b.type for b in layout.blocks] and done[0].bbox == TITLE
    unread = finish_page(plan, ["<table></table>", "recovered text", "x = 1", None])  # no formula output
    assert unread[1].content.endswith("and then E = mc<sup>2</sup> holds.")
    empty = finish_page(plan, ["<table></table>", "recovered text", "x = 1", ""])  # read as nothing: dropped
    assert empty[1].content.endswith("and then holds.")
    with pytest.raises(ValueError, match="3 outputs for 4 reads"):
        finish_page(plan, ["a", "b", "c"])


def test_ocr_page_reads_every_readable_block(layout, text):
    plan = plan_page(layout, text, mode="ocr")
    assert plan.mode == "ocr" and all(b.content is None for b in plan.blocks)
    assert [(r.type, r.block) for r in plan.reads] == [
        ("doc_title", 0),
        ("text", 1),
        ("caption", 2),
        ("table", 3),
        ("text", 5),
        ("equation", 6),
    ]  # images (no image analysis) and lists are never read; inline formulas are part of the text
    assert [r.type for r in plan_page(layout, None, "ocr", image_analysis=True).reads].count("image") == 1


def test_a_txt_document_page_without_a_trustworthy_layer_is_read_as_ocr(layout):
    assert (plan_page(layout, None, "txt").mode, plan_page(layout, None, "txt").reason) == ("ocr", "no text layer")
    scan = PageText([], (612, 792), image_coverage=1.0)
    assert (plan_page(layout, scan, "txt").mode, plan_page(layout, scan, "txt").reason) == (
        "ocr",
        "pages covered by images (scans)",
    )
    with pytest.raises(ValueError, match="mode"):
        plan_page(layout, None, "auto")


def test_suspicious_pdf_text_goes_to_the_vlm_never_into_the_output():
    box = (0.1, 0.1, 0.9, 0.2)
    chars = [PdfChar(ch, (0.1 + 0.01 * i, 0.12, 0.11 + 0.01 * i, 0.14)) for i, ch in enumerate("ok \ue001\ue002\ue003")]
    good = [PdfChar(ch, (0.1 + 0.005 * i, 0.3, 0.105 + 0.005 * i, 0.32)) for i, ch in enumerate("fine " * 20)]
    page = PageText(chars + good, (612, 792), char_count=len(chars) + len(good))
    plan = plan_page(PageLayout([LayoutBlock("text", box), LayoutBlock("text", (0.1, 0.25, 0.9, 0.35))]), page, "txt")
    assert plan.blocks[0].content is None and plan.reads == [VlmRead("text", box, block=0)]
    assert plan.blocks[1].content == ("fine " * 20).strip()
