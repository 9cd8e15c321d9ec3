"""The ``standard`` tier wired into the parser: PP-DocLayoutV2 layout (replayed detections), text
from the PDF's text layer, the VLM only for the other blocks; ``ocr_mode`` per document and page;
the typed error without layout weights; options and CLI flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import CORPUS, need
from samples import (
    SAMPLE_CONTENTS,
    SAMPLE_LAYOUT,
    born_digital_pdf,
    cid_font_without_tounicode_pdf,
    image_bytes,
    sample_trace,
    scan_with_hidden_text_pdf,
    text_page,
)

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.cli.main import main
from mineru_fast.cli.options import add_options_arguments, options_from_args
from mineru_fast.errors import LayoutModelMissing, ModelLoadError, TraceError
from mineru_fast.layout import Detection
from mineru_fast.protocol.layout_trace import LayoutTrace
from mineru_fast.protocol.traces import PageTrace, Trace

BOUNDS = {task: 16 for task in ("layout", "text", "table", "equation")}  # random weights: short free runs

# A born-digital page (612 x 792 pt): a title, a paragraph of 8 lines, a caption, written by PDFium.
TITLE_TEXT = "A Synthetic Title"
LINES = [f"Line {i} of the body text says something plain." for i in range(8)]
CAPTION_TEXT = "Table 1: numbers that the table holds."
RUNS = [
    (61.2, 80, 20, TITLE_TEXT),
    *[(61.2, 130 + 14 * i, 11, line) for i, line in enumerate(LINES)],
    (61.2, 380, 10, CAPTION_TEXT),
]
TITLE, BODY, CAPTION = (0.1, 0.08, 0.6, 0.11), (0.1, 0.14, 0.9, 0.31), (0.1, 0.465, 0.9, 0.485)
TABLE, EQUATION = (0.1, 0.5, 0.9, 0.7), (0.2, 0.75, 0.8, 0.8)
DETECTIONS = [
    Detection("doc_title", 1.0, TITLE),
    Detection("text", 1.0, BODY),
    Detection("figure_title", 1.0, CAPTION),
    Detection("table", 1.0, TABLE),
    Detection("display_formula", 1.0, EQUATION),
]


def _line(box, kind: str) -> str:
    x1, y1, x2, y2 = (round(v * 1000) for v in box)
    return f"<|box_start|>{x1:03d} {y1:03d} {x2:03d} {y2:03d}<|box_end|><|ref_start|>{kind}<|ref_end|><|rotate_up|>"


# The VLM's recorded outputs for the same page (what replay forces on the blocks the VLM reads).
VLM_TRACE = Trace(
    [
        PageTrace(
            "\n".join(
                _line(box, kind)
                for box, kind in [
                    (TITLE, "title"),
                    (BODY, "text"),
                    (CAPTION, "table_caption"),
                    (TABLE, "table"),
                    (EQUATION, "equation"),
                ]
            ),
            ["VLM title", "VLM body", "VLM caption", "<fcel>7<fcel>8<nl>", "E = m c^{2}"],
        )
    ]
)


class RecordingEngine:
    """Passes requests to an engine and keeps their prompts (what the VLM was asked to read)."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    def submit(self, request):
        self.prompts.append(request.prompt)
        return self.engine.submit(request)


@pytest.fixture(scope="module")
def tiny_doclayout(tmp_path_factory):
    """A tiny synthetic PP-DocLayoutV2 (transformers form only: seconds to write)."""
    from mineru_fast.layout.synthetic import make_synthetic_doclayout

    return make_synthetic_doclayout(tmp_path_factory.mktemp("doclayout") / "tiny", "tiny", seed=0, onnx=False)


@pytest.fixture(scope="module")
def standard(tiny_model, tiny_doclayout):
    options = ParserOptions.preset("exact", tier="standard", layout_model=str(tiny_doclayout), max_new_tokens=BOUNDS)
    parser = DocumentParser.from_pretrained(tiny_model, options)
    yield parser
    parser.close()


def recording(parser: DocumentParser, **changes) -> tuple[DocumentParser, RecordingEngine]:
    from dataclasses import replace

    engine = RecordingEngine(parser.engine)
    options = replace(parser.options, **changes)
    return DocumentParser(engine, options, parser.model_dir, parser.model_info, parser.layout_detector), engine


def prompts():
    from mineru_vl_utils.mineru_client import DEFAULT_PROMPTS

    return DEFAULT_PROMPTS


def test_standard_tier_takes_text_from_the_pdf_and_sends_only_the_other_blocks_to_the_vlm(standard):
    parser, engine = recording(standard)
    doc = parser.parse(born_digital_pdf([RUNS]), replay=VLM_TRACE, layout_replay=LayoutTrace([DETECTIONS]))
    (page,) = doc.pages
    assert (page.tier, page.ocr_mode, page.ocr_reason) == ("standard", "txt", "text layer passes every check")
    assert page.status == "success" and page.layout_raw is None
    assert [b.type for b in page.blocks] == ["doc_title", "text", "caption", "table", "equation"]
    # text-like blocks: exactly the PDF's text, nothing from the VLM
    assert [b.content for b in page.blocks[:3]] == [TITLE_TEXT, " ".join(LINES), CAPTION_TEXT]
    assert all(b.raw is None and b.finish_reason is None for b in page.blocks[:3])
    # the VLM got exactly the table and the display formula, in reading order, replayed
    assert engine.prompts == [prompts()["table"], prompts()["equation"]]
    assert page.blocks[3].content == "<table><tr><td>7</td><td>8</td></tr></table>"
    assert page.blocks[4].content == "\\[\nE = m c^{2}\n\\]"
    assert page.timings["layout_model"] > 0 and "text_layer" in page.timings
    markdown = doc.to_markdown()
    assert f"# {TITLE_TEXT}" in markdown and " ".join(LINES) in markdown and "VLM" not in markdown
    data = doc.to_dict()["pages"][0]
    assert (data["tier"], data["ocr_mode"]) == ("standard", "txt")


def test_ocr_mode_ocr_reads_every_block_from_the_image(standard):
    parser, engine = recording(standard, ocr_mode="ocr")
    doc = parser.parse(born_digital_pdf([RUNS]), replay=VLM_TRACE, layout_replay=LayoutTrace([DETECTIONS]))
    (page,) = doc.pages
    assert (page.ocr_mode, page.ocr_reason) == ("ocr", "requested") and page.status == "success"
    text, table, equation = prompts()["[default]"], prompts()["table"], prompts()["equation"]
    assert engine.prompts == [text, text, text, table, equation]
    assert [b.content for b in page.blocks[:3]] == ["VLM title", "VLM body", "VLM caption"]


def test_a_garbage_text_layer_falls_back_to_the_vlm(standard):
    """A scan under a hidden text layer that does not match the image, and text in a CID font
    without a ToUnicode map: ``auto`` resolves to ``ocr``, every text block is read by the VLM."""
    for pdf, reason in (
        (scan_with_hidden_text_pdf(1), "pages covered by images (scans)"),
        (cid_font_without_tounicode_pdf(), "have no Unicode mapping"),
    ):
        parser, engine = recording(standard)
        doc = parser.parse(pdf, replay=VLM_TRACE, layout_replay=LayoutTrace([DETECTIONS]))
        (page,) = doc.pages
        assert page.ocr_mode == "ocr" and reason in page.ocr_reason
        assert [b.content for b in page.blocks[:3]] == ["VLM title", "VLM body", "VLM caption"]
        assert len(engine.prompts) == 5


def test_auto_picks_ocr_for_an_image_input(standard):
    parser, engine = recording(standard)
    doc = parser.parse(
        image_bytes(text_page(size=(612, 792)), "PNG"), replay=VLM_TRACE, layout_replay=LayoutTrace([DETECTIONS])
    )
    (page,) = doc.pages
    assert (page.ocr_mode, page.ocr_reason) == ("ocr", "an image has no text layer")
    assert len(engine.prompts) == 5 and page.blocks[1].content == "VLM body"


def test_auto_picks_txt_for_a_born_digital_corpus_pdf_and_ocr_for_a_scanned_one(standard):
    from mineru_fast.inputs.documents import open_document
    from mineru_fast.inputs.pdftext import block_text

    body = (0.05, 0.05, 0.95, 0.95)
    layouts = LayoutTrace([[Detection("text", 1.0, body)]])
    parser, engine = recording(standard)
    pdf = need(CORPUS / "academic_fig_eq_table_1p.pdf")
    (page,) = parser.parse(pdf, layout_replay=layouts).pages
    assert page.ocr_mode == "txt" and engine.prompts == []
    with open_document(pdf) as opened:
        expected = block_text(opened.page_text(0), page.blocks[0].bbox).text
    assert page.blocks[0].content == expected and len(expected) > 300

    scan = need(CORPUS / "scanned_zh_book_8p.pdf")
    (page,) = parser.parse(scan, pages="1", layout_replay=LayoutTrace([[] for _ in range(8)])).pages
    assert page.ocr_mode == "ocr" and page.blocks == []


def test_missing_layout_weights_are_a_typed_error_never_the_advanced_tier(tiny_model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    missing = tmp_path / "PP-DocLayoutV2"
    options = ParserOptions(tier="standard", layout_model=str(missing))
    assert options.resolved_tier == "standard"
    with pytest.raises(LayoutModelMissing) as error:
        DocumentParser.from_pretrained(tiny_model, options)
    message = str(error.value)
    assert str(missing) in message and "opendatalab/MinerU-4_models_onnx" in message
    assert "Layout/PP-DocLayoutV2/inference.onnx" in message and "PaddlePaddle/PP-DocLayoutV2_safetensors" in message
    assert isinstance(error.value, ModelLoadError)

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LayoutModelMissing, match="looked for opendatalab/MinerU-4_models_onnx") as error:
        DocumentParser.from_pretrained(tiny_model, ParserOptions(tier="standard"), local_files_only=True)
    assert str(tmp_path / "hub") in str(error.value)

    out = tmp_path / "out"
    page = tmp_path / "page.png"
    page.write_bytes(image_bytes(text_page(), "PNG"))
    rc = main(["parse", str(page), "-o", str(out), "--model", str(tiny_model), "--layout-model", str(missing)])
    assert rc == 2 and not out.exists()


def test_options_tier_defaults_and_checks():
    assert ParserOptions().resolved_tier == "advanced" and ParserOptions().ocr_mode == "auto"
    assert ParserOptions(layout_model="model.onnx").resolved_tier == "standard"
    assert ParserOptions(tier="advanced", layout_model="model.onnx").resolved_tier == "advanced"
    for bad in ({"tier": "flash"}, {"ocr_mode": "pdf"}, {"layout_backend": "paddle"}, {"ocr_mode": "txt"}):
        with pytest.raises(ValueError):
            ParserOptions(**bad)
    assert ParserOptions(tier="standard", ocr_mode="txt").ocr_mode == "txt"
    options = ParserOptions(tier="standard", ocr_mode="ocr", layout_model="m.onnx", layout_backend="onnx")
    assert ParserOptions(**dataclasses.asdict(options)) == options  # plain fields, serializable as before
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.tier = "advanced"  # type: ignore[misc]


def test_cli_flags_build_the_tier_options():
    import argparse

    p = argparse.ArgumentParser()
    add_options_arguments(p)
    args = p.parse_args(
        ["--tier", "standard", "--ocr-mode", "ocr", "--layout-model", "m.onnx", "--layout-backend", "onnx"]
    )
    options = options_from_args(args)
    assert (options.tier, options.ocr_mode, options.layout_model, options.layout_backend) == (
        "standard",
        "ocr",
        "m.onnx",
        "onnx",
    )
    assert options_from_args(p.parse_args([])).resolved_tier == "advanced"


def test_cli_parses_with_the_standard_tier(tiny_model, tiny_doclayout, tmp_path, capsys):
    """``--tier standard`` end to end: random detections, bounded reads; the result records the tier."""
    out = tmp_path / "out"
    pdf = tmp_path / "born.pdf"
    pdf.write_bytes(born_digital_pdf([RUNS]))
    bounds = ",".join(f"{k}={v}" for k, v in BOUNDS.items())
    args = ["parse", str(pdf), "-o", str(out), "--model", str(tiny_model), "--preset", "exact", "--quiet", "-f", "2.x"]
    rc = main([*args, "--tier", "standard", "--layout-model", str(tiny_doclayout), "--max-new-tokens", bounds])
    assert rc == 1, capsys.readouterr().err  # partial: random weights read until the 16-token bound
    result = json.loads((out / "born" / "born.json").read_text())
    assert [(p["tier"], p["ocr_mode"], p["status"]) for p in result["pages"]] == [("standard", "txt", "partial")]
    assert any(b["content"] and b["raw"] is None for b in result["pages"][0]["blocks"])  # some text from the PDF


def test_advanced_pages_record_their_tier_and_refuse_a_layout_replay(standard, tiny_model):
    advanced = DocumentParser(standard.engine, ParserOptions.preset("exact"), standard.model_dir)
    doc = advanced.parse([text_page()], replay=sample_trace(1))
    (page,) = doc.pages
    assert (page.tier, page.ocr_mode) == ("advanced", "ocr") and page.layout_raw == SAMPLE_LAYOUT
    assert [b.content for b in page.blocks if b.type != "image"] == [c for c in SAMPLE_CONTENTS if c]
    with pytest.raises(TraceError, match="tier 'standard'"):
        advanced.parse([text_page()], layout_replay=LayoutTrace([[]]))


def test_the_service_canary_replays_the_standard_tier(standard):
    from mineru_fast.serve.parsing import run_canary

    parser, engine = recording(standard)
    result = run_canary(parser)
    assert result["status"] == "success" and result["blocks"] == 3
    assert len(engine.prompts) == 3  # an image: title, text and table read by the VLM


def test_vlm_trace_contents_match_detected_blocks_by_box_then_label():
    trace = PageTrace(_line(BODY, "text") + "\n" + _line(BODY, "title") + "\n" + _line(TABLE, "table"), ["t", "h", "x"])
    assert trace.content_near("paragraph_title", BODY) == "h"  # title -> PP-DocLayoutV2 paragraph_title
    assert trace.content_near("text", (0.101, 0.136, 0.9, 0.31)) == "t"  # within 0.005
    assert trace.content_near("text", (0.106, 0.14, 0.9, 0.31)) is None  # too far
    assert trace.content_near("caption", TABLE) == "x"  # no line of that label: the box decides
    layouts = LayoutTrace.from_trace(
        Trace([trace, PageTrace("<|box_start|>0 0 5 5<|box_end|><|ref_start|>unknown<|ref_end|>")])
    )
    assert [[d.label for d in page] for page in layouts.pages] == [["text", "paragraph_title", "table"], []]
    assert layouts.pages[0][2].bbox == TABLE and layouts.pages[0][2].score == 1.0
    with pytest.raises(TraceError):
        LayoutTrace.from_trace("not a trace")


def test_invisible_and_white_text_stays_out_of_the_page_with_a_warning(standard, caplog):
    """The standard tier took hidden text (render mode 3, white on white) as the page's text."""
    from samples import hidden_text_pdf

    parser, engine = recording(standard, ocr_mode="txt")
    pdf = hidden_text_pdf("Visible words here", "SECRET INSTRUCTIONS", "white payload text")
    layouts = LayoutTrace([[Detection("text", 1.0, (0.05, 0.05, 0.95, 0.2))]])
    with caplog.at_level("WARNING", logger="mineru_fast.pipeline.parser"):
        (page,) = parser.parse(pdf, layout_replay=layouts).pages
    # the block holds white text: read from the page image by the VLM, none of the PDF's text taken
    assert engine.prompts == [prompts()["[default]"]] and page.blocks[0].raw is not None
    warning = "37 invisible or white characters in the text layer"  # both hidden lines, spaces too
    assert page.warnings[0].startswith(warning) and warning in caplog.text
