"""Tier 1: Markdown, content list and saved files of a hand-built Document."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from mineru_fast.options import ParserOptions
from mineru_fast.results.document import Document
from mineru_fast.results.page import Block, Page, layout_overlay


def sample_document() -> Document:
    image = Image.new("RGB", (1000, 2000), "white")
    blocks = [
        Block("header", (0.1, 0.01, 0.9, 0.03), 0, "Journal of Tests"),
        Block("title", (0.1, 0.05, 0.9, 0.08), 0, "Results"),
        Block("text", (0.1, 0.1, 0.9, 0.2), 0, "First paragraph."),
        Block("table_caption", (0.1, 0.21, 0.9, 0.23), 0, "Table 1: numbers"),
        Block("table", (0.1, 0.24, 0.9, 0.4), 0, "<table><tr><td>1</td></tr></table>"),
        Block("equation", (0.2, 0.45, 0.8, 0.5), 0, "\\[\nE = mc^2\n\\]"),
        Block("image", (0.1, 0.55, 0.5, 0.8)),
        Block("image_caption", (0.1, 0.81, 0.5, 0.83), 0, "Figure 1: a cat"),
        Block("page_number", (0.45, 0.97, 0.55, 0.99), 0, "7"),
    ]
    page = Page(0, image.size, blocks, image=image)
    return Document("paper", pages=[page])


def test_markdown_follows_mineru_4_and_drops_paratext():
    md = sample_document().to_markdown()
    assert md == (
        "## Results\n\nFirst paragraph.\n\nTable 1: numbers\n\n| 1 |\n| --- |\n\n$$\nE = mc^2\n$$\n\n"
        "![](images/page_0_image_6.jpg)\n\nFigure 1: a cat"
    )


def test_content_list_matches_mineru_4_format():
    items = sample_document().to_content_list()
    assert [i["type"] for i in items] == ["header", "text", "text", "table", "equation", "image", "page_number"]
    title, table, equation, image = items[1], items[3], items[4], items[5]
    assert title == {"type": "text", "text": "Results", "text_level": 2, "bbox": [100, 50, 900, 80], "page_idx": 0}
    assert table == {
        "type": "table",
        "img_path": "images/page_0_table_4.jpg",
        "table_caption": ["Table 1: numbers"],
        "table_footnote": [],
        "table_body": "<table><tr><td>1</td></tr></table>",
        "bbox": [100, 240, 900, 400],
        "page_idx": 0,
    }
    assert equation["text"] == "E = mc^2" and equation["text_format"] == "latex"
    assert equation["img_path"] == "images/page_0_equation_5.jpg"
    assert image["image_caption"] == ["Figure 1: a cat"] and image["image_footnote"] == []
    assert items[0]["text"] == "Journal of Tests"


def test_save_writes_mineru4s_bundle_page_by_page(tmp_path):
    """The default output is MinerU 4's bundle (mineru 4.0.12 ParseResult.save's files), no overlay."""
    doc = sample_document()
    out = doc.save(tmp_path / "paper")
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert names == [
        "images", "images/page_0_equation_5.jpg", "images/page_0_image_6.jpg", "images/page_0_table_4.jpg",
        "markdown.md", "middle_json.json", "model_output.json", "structured_content.json",
    ]  # fmt: skip
    assert (out / "markdown.md").read_text() == doc.to_markdown()
    middle = doc.to_middle_json()
    assert (out / "middle_json.json").read_text() == json.dumps(middle, ensure_ascii=False, indent=2)
    assert (out / "structured_content.json").read_text() == json.dumps(
        doc.to_structured_content(), ensure_ascii=False, indent=2
    )
    assert middle["schema"] == "docvortex.middle" and middle["schema_version"] == "2.0"
    assert middle["metadata"]["producer"]["name"] == "mineru-fast" and middle["is_full_document"] is True
    assert middle["extensions"]["mineru_fast"]["status"] == "success"
    blocks = middle["pages"][0]["blocks"]
    table = next(b for b in blocks if b["type"] == "table")
    assert [c["type"] for c in table["content"]] == ["table_caption", "table_body"]
    assert table["content"][1]["image_path"] == "images/page_0_table_4.jpg"
    model = json.loads((out / "model_output.json").read_text())
    assert model["schema"] == "docvortex.model" and len(model["pages"]) == 1 and model["page_index_map"] == []
    assert Image.open(out / "images" / "page_0_table_4.jpg").size == (800, 320)


def test_middle_json_validates_against_docvortexs_schema():
    """DocVortex ships its schema as code (pydantic models, ``docvortex.schema``), not as a file
    this lane could read without it; CI's official lane has it."""
    schema = pytest.importorskip("docvortex.schema", reason="docvortex not installed (the mineru4 extra)")
    middle = schema.MiddleJson.from_dict(sample_document().to_middle_json())
    assert [block.type for block in middle.pages[0].blocks][:2] == ["header", "paragraph_title"]


def test_save_in_the_2x_layout_writes_markdown_json_crops_and_overlay(tmp_path):
    doc = sample_document()
    out = doc.save(tmp_path / "paper", layout="2.x")
    assert (out / "paper.md").read_text() == doc.to_markdown()
    assert json.loads((out / "paper_content_list.json").read_text()) == doc.to_content_list()
    assert (out / "paper_content_list.json").read_text() == json.dumps(
        doc.to_content_list(), ensure_ascii=False, indent=2
    )
    assert json.loads((out / "paper.json").read_text())["status"] == "success"
    crops = sorted(p.name for p in (out / "images").iterdir())
    assert crops == ["page_0_equation_5.jpg", "page_0_image_6.jpg", "page_0_table_4.jpg"]
    assert Image.open(out / "images" / "page_0_table_4.jpg").size == (800, 320)
    assert Image.open(out / "layout" / "page_0001.png").size == (1000, 2000)
    with pytest.raises(ValueError, match="layout must be one of"):
        doc.save(tmp_path / "other", layout="3.x")


def test_streaming_writer_releases_pages_and_matches_the_whole_document(tmp_path):
    from mineru_fast.results.writer import DocumentWriter

    doc = Document("two", pages=[sample_document().pages[0], Page(1, (10, 10))])
    writer = DocumentWriter(tmp_path, "two")
    for page in doc.pages:
        writer.add_page(page)
        page.image = None  # written: the writer needs it no longer
    writer.close()
    assert (tmp_path / "markdown.md").read_text() == doc.to_markdown()
    assert json.loads((tmp_path / "middle_json.json").read_text()) == doc.to_middle_json()
    assert json.loads((tmp_path / "structured_content.json").read_text()) == doc.to_structured_content()
    assert [p["page_idx"] for p in doc.to_middle_json()["pages"]] == [0, 1]
    assert len(list((tmp_path / "images").iterdir())) == 3


def test_empty_document_writes_empty_outputs(tmp_path):
    Document("empty").save(tmp_path)
    assert (tmp_path / "markdown.md").read_text() == ""
    middle = json.loads((tmp_path / "middle_json.json").read_text())
    assert middle["pages"] == [] and middle == Document("empty").to_middle_json()
    assert json.loads((tmp_path / "structured_content.json").read_text())["pages"] == []
    Document("empty").save(tmp_path / "old", layout="2.x")
    assert (tmp_path / "old" / "empty.md").read_text() == ""
    assert (tmp_path / "old" / "empty_content_list.json").read_text() == "[]"


def test_overlay_draws_boxes_on_the_page():
    overlay = layout_overlay(sample_document().pages[0])
    assert overlay.getpixel((100, 480)) != (255, 255, 255)  # table box outline
    assert overlay.getpixel((950, 1500)) == (255, 255, 255)  # outside every box


def test_status_reflects_page_failures():
    doc = sample_document()
    doc.pages.append(Page(1, status="failure", errors=["CorruptDocument: bad page"]))
    assert doc.status == "partial"
    assert Document("x", pages=[Page(0, status="failure")]).status == "failure"
    assert Document("x", errors=["InputError: nope"]).status == "failure"


def test_document_renders_as_markdown_in_notebooks():
    doc = sample_document()
    assert doc._repr_markdown_() == doc.to_markdown()


def test_options_validate_and_presets_apply():
    assert ParserOptions.preset("exact").precision == "fp32"
    exact = ParserOptions.preset("exact")
    assert exact.engine == "fast" and exact.kv_dtype == "auto"
    assert {exact.vision_quant, exact.lm_quant, exact.lm_head_quant} == {"bf16-weights"}  # exact upcasts
    assert ParserOptions.preset("reference").engine == "reference"
    assert ParserOptions(max_new_tokens={"layout": 8}).sampling("layout").max_new_tokens == 8
    assert ParserOptions(max_new_tokens={"text": 9}).sampling("title").max_new_tokens == 9
    assert ParserOptions().sampling("table").max_new_tokens == 8192
    for bad in (
        {"precision": "fp8"},
        {"threads": 0},
        {"max_new_tokens": {"chart": 3}},
        {"model_version": "2511"},
        {"engine": "vllm"},
        {"kv_dtype": "int4"},
    ):
        with pytest.raises(ValueError):
            ParserOptions(**bad)
    with pytest.raises(ValueError, match="unknown preset"):
        ParserOptions.preset("turbo")


def test_image_analysis_follows_the_model_version_unless_set():
    assert ParserOptions().resolved_image_analysis("pro-2605") is True
    assert ParserOptions().resolved_image_analysis("2509") is False
    assert ParserOptions(image_analysis=True).resolved_image_analysis("2509") is True
