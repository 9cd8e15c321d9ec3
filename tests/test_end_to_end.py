"""Tier 3: whole parses through the CLI and DocumentParser, on corpus files and replayed workloads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import CORPUS, WORKLOAD, need
from samples import pdf_bytes

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.cli import main
from mineru_fast.inputs import open_document
from mineru_fast.protocol import PARATEXT_TYPES, layout_image, parse_layout
from mineru_fast.traces import html_table_cells, load_trace

# Random weights never emit a valid layout, so bounding the layout step keeps each page short.
BOUNDS = "layout=48,text=16,table=16,equation=16"


@pytest.fixture(scope="module")
def parser(tiny_model):
    return DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact"))


def test_every_corpus_file_parses(tiny_model, tmp_path, capsys):
    files = sorted(p for p in need(CORPUS).iterdir() if p.suffix != ".md" and "password_required" not in p.name)
    rc = main(
        [
            "parse",
            *map(str, files),
            "-o",
            str(tmp_path),
            "--model",
            str(tiny_model),
            "--preset",
            "exact",
            "--max-new-tokens",
            BOUNDS,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    for f in files:
        result = json.loads((tmp_path / f.stem / f"{f.stem}.json").read_text())
        assert result["status"] == "success"
        assert all(p["size"][0] > 0 for p in result["pages"])
        assert (tmp_path / f.stem / "layout" / "page_0001.png").is_file()
    frames = json.loads((tmp_path / "doclaynet_page_2frames" / "doclaynet_page_2frames.json").read_text())
    assert len(frames["pages"]) == 2
    academic = json.loads((tmp_path / "academic_tableformer_10p" / "academic_tableformer_10p.json").read_text())
    assert [p["page_idx"] for p in academic["pages"]] == list(range(10))


def test_password_pdf_exits_2_then_parses_with_password(tiny_model, tmp_path, capsys):
    pdf = need(CORPUS / "password_required_pw-1234.pdf")
    args = ["parse", str(pdf), "-o", str(tmp_path), "--model", str(tiny_model), "--max-new-tokens", BOUNDS]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "--password" in err and len(err.splitlines()) == 1
    assert main([*args, "--password", "1234"]) == 0
    assert (tmp_path / pdf.stem / f"{pdf.stem}.md").is_file()


@pytest.mark.parametrize(
    "data",
    [b"", bytes(range(256)) * 64, pdf_bytes(2)[:600]],
    ids=["zero-bytes", "binary-named-pdf", "truncated-pdf"],
)
def test_bad_inputs_exit_2_before_the_model_loads_with_one_line(tmp_path, data):
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(data)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mineru_fast.cli",
            "parse",
            str(bad),
            "-o",
            str(tmp_path / "out"),
            "--model",
            str(tmp_path / "no-model-here"),  # loading it would fail: the input is checked first
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mineru-fast: ") and "Traceback" not in proc.stderr
    assert "model" not in lines[0] and "bad" in lines[0]


def test_usage_errors_exit_2(tiny_model, tmp_path, capsys):
    assert main(["parse", str(tmp_path / "missing.pdf"), "-o", str(tmp_path), "--model", str(tiny_model)]) == 2
    assert "no such file" in capsys.readouterr().err
    pdf = tmp_path / "ok.pdf"
    pdf.write_bytes(pdf_bytes(1))
    assert main(["parse", str(pdf), "-o", str(tmp_path), "--model", str(tmp_path / "nomodel")]) == 2
    assert "no such model directory" in capsys.readouterr().err
    for argv in (["parse", str(pdf), "-o", str(tmp_path), "--threads", "0"], ["bench", "--pages", "-1"],
                 ["parse", str(pdf), "-o", str(tmp_path), "--slots", "x"]):  # fmt: skip
        with pytest.raises(SystemExit) as exited:  # argparse: usage line + one error line
            main(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].split(": error: argument ")[1].startswith(argv[-2])
    assert main(["bench", "--only", "nomatch"]) == 2
    assert "matches no stage row" in capsys.readouterr().err


def test_bad_page_fails_alone(tiny_model, tmp_path):
    bounds = {task: 16 for task in ("layout", "text", "table", "equation")}  # random weights: keep pages short
    parser = DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", max_new_tokens=bounds))
    path = tmp_path / "two.pdf"
    path.write_bytes(pdf_bytes(2))
    doc = parser.parse(path, pages="1-2")
    assert [p.status for p in doc.pages] == ["success", "success"]

    with open_document(path) as opened:
        first_layout = layout_image(opened.render(0)).tobytes()

    class BrokenOnPage:
        """Raises on any batch holding page 1's layout request (the window, then page 1 alone)."""

        def __init__(self, engine, poison):
            self.engine, self.poison = engine, poison

        def generate(self, requests, on_result=None):
            if any(r.image.tobytes() == self.poison for r in requests):
                raise RuntimeError("engine blew up")
            return self.engine.generate(requests, on_result)

    broken = DocumentParser(BrokenOnPage(parser.engine, first_layout), parser.options, parser.model_dir)
    doc = broken.parse(path)
    assert [p.status for p in doc.pages] == ["failure", "success"]
    assert "engine blew up" in doc.pages[0].errors[0] and doc.status == "partial"


def markdown_tables(markdown: str) -> list[str]:
    return re.findall(r"<table>.*?</table>", markdown, flags=re.DOTALL)


def ground_truth_tables(image_name: str) -> list[str]:
    pages = json.loads((WORKLOAD / "annotations.json").read_text())
    (page,) = [p for p in pages if p["page_info"]["image_path"] == image_name]
    tables = sorted((d for d in page["layout_dets"] if d["category_type"] == "table"), key=lambda d: d["order"])
    return [d["html"] for d in tables]


def assert_replayed_markdown(markdown: str, trace, image_name: str) -> None:
    """Every text/title content of the trace appears in reading order, no paratext paragraph
    appears, and the tables have the ground truth's cells (spans and text)."""
    blocks, _ = parse_layout(trace.layout)
    paragraphs = [p.strip() for p in markdown.split("\n\n")]
    position = 0
    for block, content in zip(blocks, trace.contents, strict=True):
        if block.type in ("text", "title") and content and content.strip():
            found = markdown.find(content.strip(), position)
            assert found >= 0, f"missing or out of order: {content[:60]!r}"
            position = found + len(content.strip())
        if block.type in PARATEXT_TYPES and content and content.strip():
            assert content.strip() not in paragraphs, f"paratext in markdown: {content!r}"
    got = [html_table_cells(t) for t in markdown_tables(markdown)]
    assert got == [html_table_cells(t) for t in ground_truth_tables(image_name)]


def workload_images() -> list[str]:
    if not WORKLOAD.exists():
        return []
    return sorted(p.name for p in (WORKLOAD / "images").iterdir())


@pytest.mark.parametrize(
    "image_name", workload_images() or [pytest.param("none", marks=pytest.mark.skip("no workload"))]
)
def test_replayed_workload_page_gives_expected_markdown(parser, workload_traces, image_name):
    trace_path = workload_traces / f"{image_name.rsplit('.', 1)[0]}.json"
    trace = load_trace(trace_path).pages[0]
    doc = parser.parse(WORKLOAD / "images" / image_name, replay=trace_path)
    (page,) = doc.pages
    assert page.status == "success", page.errors
    assert page.layout_raw == trace.layout
    blocks, _ = parse_layout(trace.layout)
    assert len(page.blocks) == len(blocks) == len(trace.contents)

    assert_replayed_markdown(doc.to_markdown(), trace, image_name)


def test_cli_replay_directory_and_stream_many(tiny_model, workload_traces, tmp_path, capsys):
    images = sorted((need(WORKLOAD) / "images").iterdir())[:2]
    rc = main(
        [
            "parse",
            *map(str, images),
            "-o",
            str(tmp_path),
            "--model",
            str(tiny_model),
            "--replay",
            str(workload_traces),
            "--preset",
            "exact",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    for image in images:
        content_list = json.loads((tmp_path / image.stem / f"{image.stem}_content_list.json").read_text())
        assert content_list and all(0 <= v <= 1000 for item in content_list for v in item["bbox"])
