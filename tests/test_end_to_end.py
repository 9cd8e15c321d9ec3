"""Tier 3: whole parses through the CLI and DocumentParser, on corpus files and replayed workloads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CORPUS, WORKLOAD, need
from PIL import Image
from samples import SAMPLE_CONTENTS, SAMPLE_LAYOUT, pdf_bytes, sample_trace, text_page

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.cli.main import main
from mineru_fast.engine.base import GenerationResult, RequestHandle
from mineru_fast.inputs.documents import open_document
from mineru_fast.protocol.spec import layout_image
from mineru_fast.protocol.traces import PageTrace, Trace, html_table_cells, layout_lines, load_trace
from mineru_fast.results.mineru4 import normalize_text

# Random weights never emit a valid layout and read crops endlessly: bounds keep free-running pages
# short; replayed ones fit (SAMPLE_LAYOUT is ~90 tokens).
BOUNDS = "layout=160,text=16,table=16,equation=16"


@pytest.fixture(scope="module")
def parser(tiny_model):
    return DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact"))


@pytest.mark.slow
def test_every_corpus_file_parses(tiny_model, tmp_path, capsys):
    """Every page of every corpus file goes through the whole pipeline (render, layout request,
    crops, content requests, writer) with a replayed four-block layout."""
    files = sorted(p for p in need(CORPUS).iterdir() if p.suffix != ".md" and "password_required" not in p.name)
    traces = tmp_path / "traces"
    traces.mkdir()
    for f in files:
        with open_document(f) as opened:
            sample_trace(opened.page_count).save(traces / f"{f.stem}.json")
    out = tmp_path / "out"
    args = ["parse", *map(str, files), "-o", str(out), "--model", str(tiny_model), "--replay", str(traces)]
    rc = main([*args, "--preset", "exact", "--max-new-tokens", BOUNDS, "-f", "2.x"])  # <stem>.json, overlays
    assert rc == 0, capsys.readouterr().err
    for f in files:
        result = json.loads((out / f.stem / f"{f.stem}.json").read_text())
        assert result["status"] == "success"
        assert all(p["size"][0] > 0 and len(p["blocks"]) == 4 for p in result["pages"])
        assert (out / f.stem / "layout" / "page_0001.png").is_file()
        assert "A replayed paragraph of body text." in (out / f.stem / f"{f.stem}.md").read_text()
    frames = json.loads((out / "doclaynet_page_2frames" / "doclaynet_page_2frames.json").read_text())
    assert len(frames["pages"]) == 2
    academic = json.loads((out / "academic_tableformer_10p" / "academic_tableformer_10p.json").read_text())
    assert [p["page_idx"] for p in academic["pages"]] == list(range(10))


def test_garbage_layout_is_a_failure_and_dropped_lines_make_a_page_partial(parser):
    """A layout output with no valid line is not an empty successful page, and malformed lines
    beside valid ones are reported: the page is partial and its warnings say what was dropped."""
    image = text_page()
    garbage = Trace([PageTrace("<|box_start|>1 2 3<|box_end|> junk <|ref_start|>text", [])])
    (page,) = parser.parse(image, replay=garbage).pages
    assert page.status == "failure" and page.blocks == [] and "no valid block" in page.errors[0].message
    mixed = SAMPLE_LAYOUT + "\n<|box_start|>100 900 900 2000<|box_end|><|ref_start|>text<|ref_end|>"
    (page,) = parser.parse(image, replay=Trace([PageTrace(mixed, [*SAMPLE_CONTENTS, "lost"])])).pages
    assert page.status == "partial" and len(page.blocks) == 4
    assert any("dropped 1 malformed or out-of-range layout line" in w for w in page.warnings)


def test_password_pdf_exits_2_then_parses_with_password(tiny_model, tmp_path, capsys):
    pdf = need(CORPUS / "password_required_pw-1234.pdf")
    trace = tmp_path / "trace.json"
    sample_trace(8).save(trace)
    args = ["parse", str(pdf), "-o", str(tmp_path), "--model", str(tiny_model), "--max-new-tokens", BOUNDS]
    assert main([*args, "--replay", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--password" in err and len(err.splitlines()) == 1
    assert main([*args, "--replay", str(trace), "--password", "1234"]) == 0
    assert "A replayed title" in (tmp_path / pdf.stem / "markdown.md").read_text()


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
            "mineru_fast.cli.main",
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


def test_inputs_that_would_share_an_output_folder_are_refused(tiny_model, tmp_path, capsys):
    """``a.pdf`` in two folders (and ``a.png``) all write ``OUTPUT/a/``: the last used to overwrite
    the others silently. Refused before anything is parsed; so is an ``-o`` that is a file."""
    for folder in ("x", "y"):
        (tmp_path / "in" / folder).mkdir(parents=True)
        (tmp_path / "in" / folder / "a.pdf").write_bytes(pdf_bytes(1))
    text_page().save(tmp_path / "in" / "y" / "a.png")
    out = tmp_path / "out"
    assert main(["parse", str(tmp_path / "in"), "-o", str(out), "--model", str(tiny_model)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.endswith("would both write a/: rename one") for line in err)
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    pdf = tmp_path / "in" / "x" / "a.pdf"
    assert main(["parse", str(pdf), "-o", str(afile), "--model", str(tiny_model)]) == 2
    assert capsys.readouterr().err.strip() == f"mineru-fast: -o {afile} exists and is not a directory"


def test_json_progress_reports_input_errors_as_events_and_0_based_pages(tiny_model, tmp_path, capsys):
    """``--progress json`` printed a missing or unsupported input as a plain line, and its ``page``
    was 1-based while the ``page`` of the ``ParseError`` it reports is 0-based."""
    (tmp_path / "bad.pdf").write_bytes(b"not a document")
    (tmp_path / "two.pdf").write_bytes(pdf_bytes(2))
    (tmp_path / "traces").mkdir()
    garbage = PageTrace("no layout here", [])
    Trace([sample_trace(1).pages[0], garbage]).save(tmp_path / "traces" / "two.json")
    inputs = [str(tmp_path / name) for name in ("missing.pdf", "bad.pdf", "two.pdf")]
    argv = ["parse", *inputs, "-o", str(tmp_path / "out"), "--model", str(tiny_model), "--pages", "2"]
    assert main([*argv, "--replay", str(tmp_path / "traces"), "--progress", "json"]) == 1  # two.pdf parsed
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(e["event"], e["input"]) for e in events] == [
        ("error", inputs[0]),
        ("error", inputs[1]),
        ("page", inputs[2]),
    ]
    assert events[0]["code"] == "document_not_found" and events[0]["message"] == f"no such file: {inputs[0]}"
    assert events[1]["code"] == "unsupported_format" and not events[1]["message"].startswith("Unsupported")
    page = events[2]
    assert (page["page_index"], page["status"], page["done"], page["total"]) == (1, "failure", 1, 1)
    assert page["errors"] == [{"code": "layout_unreadable", "message": "layout output holds no valid block", "page": 1}]


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def _no_permission(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self))


@pytest.mark.parametrize("failure", ["stem-is-a-file", "full-disk", "read-only"])
def test_output_errors_are_one_line_with_their_own_status_and_leave_no_half_written_files(
    tiny_model, tmp_path, capsys, monkeypatch, failure
):
    """Output errors used to end in a traceback and exit 1 (the code for "pages failed"), leaving a
    0-byte content list behind."""
    from mineru_fast.results import writer

    (tmp_path / "two.pdf").write_bytes(pdf_bytes(2))
    sample_trace(2).save(tmp_path / "two.json")
    out = tmp_path / "out"
    out.mkdir()
    if failure == "stem-is-a-file":
        (out / "two").write_text("a file")
    elif failure == "full-disk":  # the second page's crops do not fit
        write_page_images = writer.write_page_images
        calls = iter([write_page_images, _no_space])
        monkeypatch.setattr(writer, "write_page_images", lambda *a, **k: next(calls)(*a, **k))
    else:
        monkeypatch.setattr(writer.Path, "mkdir", _no_permission)
    argv = ["parse", str(tmp_path / "two.pdf"), "-o", str(out), "--model", str(tiny_model), "--quiet"]
    assert main([*argv, "--replay", str(tmp_path / "two.json")]) == 4
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("mineru-fast: error: cannot write the outputs of two in ") and captured.out == ""
    expected = {"stem-is-a-file": "File exists", "full-disk": "No space left on device", "read-only": "Permission"}
    assert expected[failure] in line
    if failure == "stem-is-a-file":
        assert (out / "two").read_text() == "a file"
    else:
        assert [p for p in out.rglob("*") if p.is_file()] == []


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
    # 16 tokens cut every random-weight layout: each page says so (partial), none fails
    assert [p.status for p in doc.pages] == ["partial", "partial"]
    assert all("layout output was cut (length)" in p.warnings[-1] for p in doc.pages)

    with open_document(path) as opened:
        first_layout = layout_image(opened.render(0)).tobytes()

    class BrokenOnPage:
        """Fails page 1's layout request, as the engine does for a request it cannot run."""

        def __init__(self, engine, poison):
            self.engine, self.poison = engine, poison

        def submit(self, request):
            if request.image.tobytes() != self.poison:
                return self.engine.submit(request)
            handle = RequestHandle(request)
            handle.set_result(GenerationResult.failed(RuntimeError("engine blew up")))
            return handle

    broken = DocumentParser(BrokenOnPage(parser.engine, first_layout), parser.options, parser.model_dir)
    doc = broken.parse(path)
    assert [p.status for p in doc.pages] == ["failure", "partial"]
    (error,) = doc.pages[0].errors
    assert (error.code, error.page) == ("engine_error", 0)
    assert error.message == "layout step failed: RuntimeError: engine blew up"  # the code, not a class, says engine
    assert doc.status == "partial"


def ground_truth_tables(image_name: str) -> list[str]:
    pages = json.loads((WORKLOAD / "annotations.json").read_text())
    (page,) = [p for p in pages if p["page_info"]["image_path"] == image_name]
    tables = sorted((d for d in page["layout_dets"] if d["category_type"] == "table"), key=lambda d: d["order"])
    return [d["html"] for d in tables]


def expected_outputs(trace, image_name: str) -> tuple[str, list[dict]]:
    """Markdown and content list that the protocol functions give for a trace without an engine."""
    from official_replay import fast_outputs

    with Image.open(WORKLOAD / "images" / image_name) as image:  # image analysis on, as the parser reads
        markdown, content_list = fast_outputs([image.convert("RGB")], [trace], image_analysis=True)
    return markdown.decode("utf-8"), json.loads(content_list)


def assert_replayed_outputs(markdown: str, content_list: list[dict], trace, image_name: str) -> None:
    """A replayed parse writes what the protocol functions give for the trace without an engine, and
    its tables have the ground truth's cells (spans and text)."""
    assert (markdown, content_list) == expected_outputs(trace, image_name)

    def cells(html_text: str) -> list:  # text compared after MinerU 4's half-width normalization
        return [[(r, c, normalize_text(t)) for r, c, t in row] for row in html_table_cells(html_text.replace("$", ""))]

    tables = [item["table_body"] for item in content_list if item["type"] == "table"]
    assert [cells(t) for t in tables] == [cells(t) for t in ground_truth_tables(image_name)]


def workload_images() -> list[str]:
    if not WORKLOAD.exists():
        return []
    return sorted(p.name for p in (WORKLOAD / "images").iterdir())


MEDIAN_PAGE = "jiaocaineedrop_Chapter9.pdf_46.jpg"  # the workload's median page: the default lane's one


def workload_params() -> list:
    """The workload pages as parameters: the median page in the default lane, the others ``slow``."""
    names = workload_images()
    if not names:
        return [pytest.param("none", marks=pytest.mark.skip(reason="no workload"))]
    return [name if name == MEDIAN_PAGE else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.mark.parametrize("image_name", workload_params())
def test_replayed_workload_page_gives_expected_markdown(parser, workload_traces, image_name):
    trace_path = workload_traces / f"{image_name.rsplit('.', 1)[0]}.json"
    trace = load_trace(trace_path).pages[0]
    doc = parser.parse(WORKLOAD / "images" / image_name, replay=trace_path)
    (page,) = doc.pages
    assert page.status == "success", page.errors
    assert page.layout_raw == trace.layout
    assert len(layout_lines(trace.layout)) == len(trace.contents)
    assert page.warnings == []
    assert_replayed_outputs(doc.to_markdown(), doc.to_content_list(), trace, image_name)


@pytest.mark.slow
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
            "-f",
            "2.x",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    for image in images:
        content_list = json.loads((tmp_path / image.stem / f"{image.stem}_content_list.json").read_text())
        assert content_list and all(0 <= v <= 1000 for item in content_list for v in item["bbox"])


def test_token_bounds_bound_free_decoding_not_a_replayed_output(tiny_model, tmp_path):
    """The CLI and Python API cut a replayed output at ``max_new_tokens`` (page ``partial``) while
    ``serve`` replayed it whole (``success``): one behaviour now, the service's."""
    bounds = {"layout": 8, "text": 2}  # SAMPLE_LAYOUT is ~90 tokens, each content a few
    parser = DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", max_new_tokens=bounds))
    (page,) = parser.parse(text_page(), replay=sample_trace(1)).pages
    read = [block for block in page.blocks if block.type != "image"]
    assert page.status == "success" and [b.finish_reason for b in read] == ["stop"] * 3
    assert [b.content for b in read] == [c for c in SAMPLE_CONTENTS if c]
    assert parser.options.sampling("text").max_new_tokens == 2  # free decoding stays bounded
    assert parser.options.sampling("text", replayed=True).max_new_tokens == 4096
