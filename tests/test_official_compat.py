"""Differential lane: official MinerU 4.0.12 and mineru-fast write the same files for the same raw
model outputs (see ``official_replay``). Skips where the official packages are not installed; CI runs
it in its own environment (``.ci/run``, official lane)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import WORKLOAD, need
from PIL import Image

pytest.importorskip("mineru.parser.mineru_parser", reason="official mineru 4.0.12 not installed (official CI lane)")
pytest.importorskip("docvortex", reason="docvortex (mineru's writer) not installed (official CI lane)")

from official_replay import fast_outputs, official_outputs  # noqa: E402

from mineru_fast.traces import PageTrace, build_omnidocbench_traces, load_trace  # noqa: E402


def line(box: str, kind: str, tail: str = "<|rotate_up|>") -> str:
    return f"<|box_start|>{box}<|box_end|><|ref_start|>{kind}<|ref_end|>{tail}"


def page(*lines_and_contents: tuple[str, str | None]) -> PageTrace:
    return PageTrace("\n".join(ln for ln, _ in lines_and_contents), [c for _, c in lines_and_contents])


# Every block type of mineru-vl-utils 2.x (and one it does not know), rotated blocks, equation blocks,
# nested captions, [Non-Text], inline math, text and tables that need escaping.
SYNTHETIC: dict[str, list[PageTrace]] = {
    "all_types": [
        page(
            (line("100 020 900 040", "header"), "Header ＡＢ１"),
            (line("100 050 900 080", "doc_title"), "A Document Title"),
            (line("100 085 900 100", "paragraph_title"), "1 Section"),
            (line("100 105 900 120", "title"), "1.1 Sub\nsection"),
            (line("100 125 900 160", "text"), "# not a heading, *x* and _y_ cost $5; \\(a^2+b^2\\) ＸＹＺ：ok"),
            (line("100 165 900 180", "list_item"), "- an item"),
            (line("100 185 900 200", "phonetic"), "pīn yīn"),
            (line("100 205 900 240", "code"), "```python\nprint('hi')\n```"),
            (line("100 245 900 270", "algorithm"), "for i in \\(1..n\\) do"),
            (line("100 275 900 300", "ref_text"), "[1] A. Author. A paper. 2020."),
            (line("100 305 900 330", "ref_text"), "[2] B. Author. Another. 2021."),
            (line("100 335 900 360", "index"), "Intro ..... 1\nMethods ..... 5"),
            (line("100 365 800 400", "equation"), "\\[E = mc^2\\]"),
            (line("850 370 900 395", "formula_number"), "(1)"),
            (line("100 405 900 420", "aside_text"), "side"),
            (line("100 445 900 460", "caption"), "Figure 9: generic"),
            (line("100 465 900 560", "chart"), None),
            (line("100 565 900 580", "footnote"), "source: us"),
            (line("100 600 900 640", "code_caption"), "Listing 1"),
            (line("100 650 900 700", "code"), "x = 1\ny = 2"),
            (line("100 940 900 960", "page_footnote"), "1 A footnote with <b>tags</b> & more."),
            (line("100 970 900 990", "footer"), "Footer"),
            (line("450 990 550 999", "page_number"), "12"),
        )
    ],
    "two_pages": [
        page((line("100 100 900 200", "title"), "Part A"), (line("100 300 900 400", "text"), "Page one ends here.")),
        page((line("100 050 900 080", "header"), "Running head"), (line("100 100 900 200", "text"), "Page two.")),
    ],
    # Last on its page, so the indices (image names) of the other blocks do not move.
    "unknown_type": [
        page((line("100 100 900 200", "text"), "Known."), (line("100 300 900 400", "sidebar_quote"), "Kept."))
    ],
    "visuals": [
        page(
            (line("100 050 900 070", "table_caption"), "Table 1: values | pipes & <lt>"),
            (line("100 080 900 300", "table"), "<fcel>a|b<fcel>\\(x_1\\)<nl><fcel>1<fcel>2 & 3<nl>"),
            (line("100 310 900 330", "table_footnote"), "* significant"),
            (line("100 350 450 600", "image"), None),
            (line("100 610 450 630", "image_caption"), "Fig. 1a"),
            (line("500 350 900 600", "image"), None),
            (line("520 400 700 420", "image_caption"), "inside the image"),
            (line("500 610 900 630", "image_caption"), "Fig. 1b"),
            (line("100 640 900 660", "image_footnote"), "Both panels."),
            (line("100 700 900 900", "table"), "<fcel>h<lcel><nl><fcel>1<fcel>2<nl>"),
            (line("100 910 900 930", "text"), "Table 2 (continued)"),
        )
    ],
    "equations_rotation_nontext": [
        page(
            (line("100 050 900 250", "equation_block"), None),
            (line("110 060 890 140", "equation"), "\\[a = b \\tag{1}\\]"),
            (line("110 150 890 240", "equation"), "\\[c = \\left( d \\tag{2}\\]"),
            (line("100 300 150 700", "text", "<|rotate_left|>"), "vertical text"),
            (line("200 300 900 350", "text", "<|rotate_down|>"), "upside down"),
            (line("200 360 900 400", "text"), "[Non-Text]"),
            (line("200 410 900 440", "header"), "[Non-Text]"),
            (line("200 450 900 700", "table"), "[Non-Text]"),
            (line("200 710 900 740", "text", "<|rotate_up|>txt_contd_tgt"), "continues \\[1, 2\\] here"),
            (line("200 750 900 800", "list"), None),
            (line("200 750 900 775", "text"), "1. first"),
            (line("200 776 900 800", "text"), "2. second"),
            (line("200 820 900 840", "unknown"), None),
        )
    ],
}


def workload_pages() -> list[str]:
    return sorted(p.stem for p in (WORKLOAD / "images").glob("*.jpg")) if WORKLOAD.exists() else []


@pytest.fixture(scope="module")
def workload_trace_dir(tmp_path_factory):
    need(WORKLOAD)
    out = tmp_path_factory.mktemp("official_traces")
    build_omnidocbench_traces(WORKLOAD / "annotations.json", WORKLOAD / "images", out)
    return out


@pytest.mark.parametrize("name", workload_pages() or [pytest.param("none", marks=pytest.mark.skip("no workload"))])
def test_workload_page_matches_official(name, workload_trace_dir):
    trace = load_trace(workload_trace_dir / f"{name}.json")
    image_path = WORKLOAD / "images" / f"{name}.jpg"
    official_md, official_cl = official_outputs(image_path, trace.pages)
    with Image.open(image_path) as image:
        fast_md, fast_cl = fast_outputs([image.convert("RGB")], trace.pages)
    assert fast_md == official_md
    assert fast_cl == official_cl


def synthetic_outputs(name: str, tmp_path) -> tuple[tuple[str, str], tuple[str, str]]:
    pages = SYNTHETIC[name]
    images = [Image.new("RGB", (1240, 1754), "white") for _ in pages]
    pdf = tmp_path / f"{name}.pdf"
    images[0].save(pdf, save_all=True, append_images=images[1:], resolution=150)
    return official_outputs(pdf, pages), fast_outputs(images, pages)


def code_fence_language(markdown: str) -> str:
    """The one documented difference: official guesses a code block's language with Magika (a
    model); mineru-fast writes ``txt``. The fence line is compared without it."""
    return re.sub(r"^(`{3,})[A-Za-z0-9_.+#-]*$", r"\1", markdown, flags=re.MULTILINE)


@pytest.mark.parametrize("name", sorted(set(SYNTHETIC) - {"unknown_type"}))
def test_synthetic_page_matches_official(name, tmp_path):
    (official_md, official_cl), (fast_md, fast_cl) = synthetic_outputs(name, tmp_path)
    assert code_fence_language(fast_md) == code_fence_language(official_md)
    assert fast_cl == official_cl


def test_unknown_type_is_kept_where_official_drops_it(tmp_path):
    """The documented difference by design: official drops a block of a type it does not know (and
    its text); mineru-fast keeps it as text and says so. Everything else is the same."""
    (official_md, official_cl), (fast_md, fast_cl) = synthetic_outputs("unknown_type", tmp_path)
    assert official_md == "Known." and fast_md == "Known.\n\nKept."
    extra = {"type": "text", "text": "Kept.", "bbox": [100, 300, 900, 400], "page_idx": 0}
    assert json.loads(fast_cl) == [*json.loads(official_cl), extra]
