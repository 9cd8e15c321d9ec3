"""Differential lane: official MinerU 4.0.12 and mineru-fast write the same bytes for the same raw
model outputs (see ``official_replay``), for both model versions (2509: no image analysis;
Pro-2605: image analysis), the workload pages and synthetic documents that exercise each rule of
the official writer, one of them longer than official's 64-page processing window. Skips where the
official packages are not installed; CI runs it in its own environment (``.ci/run``, official lane).

Each test id names the model version, the document and the file: ``pytest -rA`` lists the per-page
equality table."""

from __future__ import annotations

import functools
import json
import re

import pytest
from conftest import WORKLOAD
from PIL import Image

pytest.importorskip("mineru.parser.mineru_parser", reason="official mineru 4.0.12 not installed (official CI lane)")
pytest.importorskip("docvortex", reason="docvortex (mineru's writer) not installed (official CI lane)")

from official_replay import RecordedPage, fast_outputs, official_outputs  # noqa: E402

from mineru_fast.protocol.traces import PageTrace, build_omnidocbench_traces, load_trace  # noqa: E402

# Model version -> image analysis, as mineru-fast resolves it (ParserOptions.resolved_image_analysis).
VERSIONS = {"2509": False, "pro-2605": True}


def line(box: str, kind: str, tail: str = "<|rotate_up|>") -> str:
    return f"<|box_start|>{box}<|box_end|><|ref_start|>{kind}<|ref_end|>{tail}"


def page(*lines_and_contents: tuple[str, str | None]) -> PageTrace:
    return PageTrace("\n".join(ln for ln, _ in lines_and_contents), [c for _, c in lines_and_contents])


# Image analysis outputs as MinerU2.5-Pro writes them (mineru-vl-utils post_process.image_analysis_postprocess).
IMAGE_ANALYSIS_CHART = (
    "<|class_start|>chart<|class_end|><|sub_class_start|>bar<|sub_class_end|><|caption_start|>Sales<|caption_end|>"
    "<|content_start|>| year | sales |\n| --- | --- |\n| 2020 | 5 |\n| 2021 | 7 |<|content_end|>"
)
IMAGE_ANALYSIS_FLOW = (
    "<|class_start|>flowchart<|class_end|><|sub_class_start|>flowchart<|sub_class_end|>"
    "<|caption_start|>Steps<|caption_end|><|content_start|>graph TD\n    A[start] --> B[end]<|content_end|>"
)


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
    # An image_block container: official collapses it into one image with the container's box and
    # drops every block at least 80 % inside it (the inner images, a label, a caption); the caption
    # below attaches to the collapsed image, later image names count the collapsed list.
    "image_block": [
        page(
            (line("100 050 900 450", "image_block"), None),
            (line("120 060 480 380", "image"), None),
            (line("520 060 880 380", "image"), None),
            (line("520 200 880 220", "text"), "label inside the figure"),
            (line("120 385 480 440", "image_caption"), "(a) left"),
            (line("850 300 990 600", "aside_text"), "half inside"),
            (line("100 460 900 480", "image_caption"), "Figure 2: two panels"),
            (line("100 500 900 540", "text"), "Body text after the figure."),
            (line("100 560 500 800", "image"), None),
            (line("100 810 500 830", "image_caption"), "Figure 3: alone"),
        )
    ],
    # Tables whose cells hold full-width characters: official re-serializes the whole table.
    "fullwidth_tables": [
        page(
            (
                line("100 050 900 250", "table"),
                '<fcel>Ａ＆Ｂ<fcel>it\'s "q" < 5<nl><fcel>１２<lcel><nl><fcel>x<ecel><nl>',
            ),
            (line("100 300 900 500", "table"), "<fcel>plain & simple<fcel>'a'<nl><fcel>1<fcel>2<nl>"),
            (line("100 550 900 750", "table"), "<fcel>\\(Ｘ_1\\)<fcel>Ｙ\\(a\\)<nl><ucel><fcel>ｚ<nl>"),
        )
    ],
    # Reference lists next to each other and across a page break (a running head between) are one
    # list in official's Markdown; the content list keeps one item per list.
    "reference_lists": [
        page(
            (line("100 050 900 080", "paragraph_title"), "References"),
            (line("100 100 900 200", "list"), None),
            (line("100 100 900 140", "ref_text"), "[1] A. One. A paper. 2020."),
            (line("100 150 900 190", "ref_text"), "[2] B. Two. Another. 2021."),
            (line("100 220 900 320", "list"), None),
            (line("100 220 900 260", "ref_text"), "[3] C. Three. 2022."),
            (line("100 270 900 310", "ref_text"), "[4] D. Four. 2023."),
            (line("100 800 900 960", "list"), None),
            (line("100 800 900 840", "ref_text"), "[5] E. Five. 2024."),
            (line("450 970 550 990", "page_number"), "7"),
        ),
        page(
            (line("100 020 900 040", "header"), "Running head"),
            (line("100 100 900 200", "list"), None),
            (line("100 100 900 140", "ref_text"), "[6] F. Six. 2025."),
            (line("100 300 900 340", "text"), "Appendix text."),
        ),
    ],
    # Official's numbered-item rule for reference lists: a digit in the first five characters.
    "reference_numbering": [
        page(
            (line("100 050 900 200", "list"), None),
            (line("100 050 900 090", "ref_text"), "1 Smith, J. A paper."),
            (line("100 100 900 140", "ref_text"), "【2】 Doe, J. Another."),
            (line("100 150 900 190", "ref_text"), "3、 Li, K. Third."),
            (line("100 210 900 230", "text"), "Further reading"),
            (line("100 250 900 400", "list"), None),
            (line("100 250 900 290", "ref_text"), "Smith, J. No number."),
            (line("100 300 900 340", "ref_text"), "Doe, J. None here either."),
            (line("100 350 900 390", "ref_text"), "- Already a bullet."),
            (line("100 410 900 430", "text"), "Mixed"),
            (line("100 450 900 600", "list"), None),
            (line("100 450 900 490", "ref_text"), "[1] Numbered."),
            (line("100 500 900 540", "ref_text"), "Not numbered at all."),
            (line("100 620 900 660", "ref_text"), "Standalone 12 reference."),
            (line("100 670 900 710", "ref_text"), "Another standalone one."),
        )
    ],
    # A table split across a page break (same columns, header repeated) is one table in official's
    # Markdown; a table of other columns on the next page is not joined; one whose first row's
    # cells line up with the last row of the table before (column spans) is, a running head between.
    "table_across_pages": [
        page(
            (line("100 100 900 140", "text"), "Results follow."),
            (line("100 600 900 950", "table"), "<fcel>name<fcel>value<nl><fcel>a<fcel>1<nl><fcel>b<fcel>2<nl>"),
        ),
        page(
            (line("100 050 900 400", "table"), "<fcel>name<fcel>value<nl><fcel>c<fcel>3<nl><fcel>d<fcel>4<nl>"),
            (line("100 420 900 460", "text"), "Another table:"),
            (line("100 600 900 950", "table"), "<fcel>x<fcel>y<nl><fcel>1<fcel>2<nl>"),
        ),
        page(
            (line("100 050 900 400", "table"), "<fcel>p<fcel>q<fcel>r<nl><fcel>1<lcel><fcel>3<nl>"),
        ),
        page(
            (line("100 020 900 040", "header"), "Running head"),
            (line("100 050 900 400", "table"), "<fcel>4<lcel><fcel>6<nl><fcel>7<fcel>8<fcel>9<nl>"),
        ),
    ],
    # Image analysis outputs (read only by MinerU2.5-Pro): a chart read as a table, a flowchart as
    # mermaid, a photo with its caption, and a chart block.
    "image_analysis": [
        page(
            (line("100 050 900 300", "image"), IMAGE_ANALYSIS_CHART),
            (line("100 310 900 330", "image_caption"), "Figure 1: sales"),
            (line("100 350 900 600", "image"), IMAGE_ANALYSIS_FLOW),
            (
                line("100 620 500 900", "image"),
                "<|class_start|>natural_image<|class_end|><|caption_start|>A cat<|caption_end|>",
            ),
            (line("520 620 900 900", "chart"), IMAGE_ANALYSIS_CHART),
        )
    ],
    # Rules not exercised elsewhere: an index's tab-separated page numbers, a "continued" line
    # leading the page above a table, a page footnote over two lines, empty equation and table
    # contents (their crops instead), carriage returns kept as written, a doc title.
    "more_rules": [
        page(
            (line("100 020 900 040", "text"), "Table 3 (continued)"),
            (line("100 045 900 200", "table"), "<fcel>a<fcel>b<nl><fcel>1<fcel>2<nl>"),
            (line("100 210 900 240", "doc_title"), "A Title\nOver Two Lines"),
            (line("100 250 900 300", "index"), "Intro\t1\nMethods\tand more\tv\nAppendix\tB\tnot a page"),
            (line("100 310 900 340", "text"), "line one\r\nline two"),
            (line("100 350 900 400", "equation"), ""),
            (line("100 410 900 500", "table"), ""),
            (line("100 900 900 950", "page_footnote"), "1 first line\nsecond line"),
        )
    ],
    # Raw outputs kept code point for code point (a letter and a combining accent stay two, as
    # official keeps a model's text), bidirectional text, and a page without blocks between two
    # others (official writes it as {"page_idx": N} in its middle JSON and structured content).
    "unicode_and_empty_page": [
        page(
            (line("100 050 900 120", "title"), "Cafe\u0301 and Caf\u00e9: A\u030a \u212b \u00c5"),
            (
                line("100 150 900 300", "text"),
                "\u05e9\u05dc\u05d5\u05dd world \u0645\u0631\u062d\u0628\u0627 e\u0301\u0302 \u1100\u1161\u11a8 "
                "\u202bRTL embed\u202c x\u0308",
            ),
        ),
        PageTrace("", []),
        page((line("100 050 900 200", "text"), "After the empty page.")),
    ],
    # Crops of rotated blocks (an image, a table, an equation, a chart, each turned upright before it
    # is read): official records each one's angle by its index in extensions.docvortex_layout's
    # image_rotations, which DocVortex's original-layout PDF turns back; an upright image and a
    # rotated text block are not recorded. Its PDF also declares properties (test_official_bundle).
    "rotated_visuals": [
        page(
            (line("100 050 900 080", "text", "<|rotate_left|>"), "Rotated text is not a crop."),
            (line("100 100 450 400", "image", "<|rotate_right|>"), None),
            (line("100 410 450 430", "image_caption"), "Fig. 2: turned"),
            (line("500 100 900 400", "image"), None),
            (line("100 450 900 650", "table", "<|rotate_left|>"), "<fcel>p<fcel>q<nl><fcel>1<fcel>2<nl>"),
            (line("100 700 900 760", "equation", "<|rotate_down|>"), "\\[x = y\\]"),
        ),
        page(
            (line("100 100 900 500", "chart", "<|rotate_right|>"), None),
            (line("100 600 900 650", "text"), "On a turned page."),
        ),
    ],
    # Inline markup in table cells (HTML tables as the model may answer them): every element
    # official renders, alone and nested, with "|", spaces and non-ASCII in link targets, in a
    # merged cell (the table stays HTML), in OTSL (escaped to text by mineru-vl-utils), and in a
    # table continued across a page break.
    "table_inline_markup": [
        page(
            (
                line("100 050 900 450", "table"),
                "<table><tr><th><b>Bold</b> and <i>italic</i></th><th><strong><em>both</em></strong></th></tr>"
                '<tr><td><code>x|y</code> <code>a`b</code></td><td><a href="http://e.x/a b">link</a></td></tr>'
                "<tr><td><u>under</u> <sup>2</sup> <sub>i</sub> <s>gone</s></td>"
                '<td><a href="http://e.x/ü(1)|z?q=\\"><b>bold link</b></a></td></tr>'
                '<tr><td><a href="http://e.x/q"><u>underlined link</u></a></td><td><b><u>bold under</u></b></td></tr>'
                "<tr><td><em> spaced </em><b>a|b</b></td><td><i><b>nest</b>ed</i> <sup><b>x</b></sup></td></tr>"
                '<tr><td><a href="">no target</a> <a>none</a></td>'
                "<td><p><span>p</span></p><br><s><u>su</u></s></td></tr>"
                "<tr><td>x<eq>a|b</eq> <code><b>c</b></code></td><td><strong>Ｂ</strong> ＆ <em>ａ</em></td></tr>"
                "</table>",
            ),
            (
                line("100 470 900 600", "table"),
                '<table><tr><td colspan="2"><b>Merged</b> <a href="http://e.x/m">l</a></td></tr>'
                "<tr><td><i>x</i></td><td><code>y</code></td></tr></table>",
            ),
            (line("100 620 900 700", "table"), "<fcel><b>o</b><fcel><a href='x'>l</a><nl><fcel>1<fcel><u>2</u><nl>"),
            (
                line("100 750 900 950", "table"),
                "<table><tr><th>name</th><th>link</th></tr>"
                '<tr><td><b>a</b></td><td><a href="http://e.x/1">one</a></td></tr></table>',
            ),
        ),
        page(
            (
                line("100 050 900 300", "table"),
                "<table><tr><th>name</th><th>link</th></tr>"
                '<tr><td><i>b</i></td><td><a href="http://e.x/二 2">two</a></td></tr></table>',
            ),
        ),
    ],
}


def long_document(pages: int = 66) -> list[PageTrace]:
    """A document longer than official's 64-page window: each page its own text, and across the
    window boundary (pages 63 -> 64, 0-based) a reference list and a table that continue, and an
    image past it (its file name carries the page number)."""
    out = []
    for n in range(pages):
        lines = [(line("100 050 900 080", "text"), f"Page {n} opens.")]
        if n == 62:
            lines += [(line("100 800 900 960", "list"), None), (line("100 800 900 840", "ref_text"), "[1] Late ref.")]
        if n == 63:
            lines = [(line("100 050 900 200", "list"), None), (line("100 050 900 090", "ref_text"), "[2] Next ref.")]
            lines += [(line("100 600 900 950", "table"), "<fcel>k<fcel>v<nl><fcel>a<fcel>1<nl>")]
        if n == 64:
            table = (line("100 050 900 400", "table"), "<fcel>k<fcel>v<nl><fcel>b<fcel>2<nl>")
            lines = [table, (line("100 420 900 450", "text"), f"Page {n} opens.")]
        if n == 65:
            lines += [
                (line("100 300 600 700", "image"), None),
                (line("100 710 600 730", "image_caption"), "Late figure"),
            ]
        out.append(page(*lines))
    return out


SYNTHETIC["long_document"] = long_document()


def workload_pages() -> list[str]:
    return sorted(p.stem for p in (WORKLOAD / "images").glob("*.jpg")) if WORKLOAD.exists() else []


@functools.cache
def workload_trace_dir(tmp_root: str):
    from pathlib import Path

    out = Path(tmp_root) / "official_traces"
    out.mkdir(exist_ok=True)
    build_omnidocbench_traces(WORKLOAD / "annotations.json", WORKLOAD / "images", out)
    return out


DOCUMENTS = [f"workload/{name}" for name in workload_pages()] + [f"synthetic/{name}" for name in sorted(SYNTHETIC)]


@functools.cache
def outputs(document: str, version: str, tmp_root: str) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """``((official md, official content list), (fast md, fast content list))`` of a document."""
    from pathlib import Path

    kind, name = document.split("/", 1)
    analysis = VERSIONS[version]
    if kind == "workload":
        traces = load_trace(workload_trace_dir(tmp_root) / f"{name}.json").pages
        source = WORKLOAD / "images" / f"{name}.jpg"
        with Image.open(source) as image:
            images = [image.convert("RGB")]
    else:
        traces = SYNTHETIC[name]
        size = (620, 877) if len(traces) > 8 else (1240, 1754)  # small pages keep the long document quick
        images = [Image.new("RGB", size, "white") for _ in traces]
        source = Path(tmp_root) / f"{name}.pdf"
        if not source.exists():
            images[0].save(source, save_all=True, append_images=images[1:], resolution=size[0] / 8.27)
    recorded = [RecordedPage(t.layout, list(t.contents)) for t in traces]
    return official_outputs(source, recorded, image_analysis=analysis), fast_outputs(
        images, traces, image_analysis=analysis
    )


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("official_lane"))


def code_fence_language(markdown: bytes) -> bytes:
    """The one documented difference in code: official guesses a code block's language with Magika
    (a model); mineru-fast writes ``txt``. The fence line is compared without it."""
    return re.sub(rb"^(`{3,})[A-Za-z0-9_.+#-]*$", rb"\1", markdown, flags=re.MULTILINE)


# Documents with a difference by design (README, "Output format"); checked in their own tests.
BY_DESIGN = {"synthetic/unknown_type"}


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d not in BY_DESIGN])
def test_markdown_matches_official(document, version, tmp_root):
    (official_md, _), (fast_md, _) = outputs(document, version, tmp_root)
    assert code_fence_language(fast_md) == code_fence_language(official_md)


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d not in BY_DESIGN])
def test_content_list_matches_official(document, version, tmp_root):
    (_, official_cl), (_, fast_cl) = outputs(document, version, tmp_root)
    assert fast_cl == official_cl


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_unknown_type_is_kept_where_official_drops_it(version, tmp_root):
    """The documented difference by design: official drops a block of a type it does not know (and
    its text); mineru-fast keeps it as text and says so. Everything else is the same."""
    (official_md, official_cl), (fast_md, fast_cl) = outputs("synthetic/unknown_type", version, tmp_root)
    assert official_md == b"Known." and fast_md == b"Known.\n\nKept."
    extra = {"type": "text", "text": "Kept.", "bbox": [100, 300, 900, 400], "page_idx": 0}
    assert json.loads(fast_cl) == [*json.loads(official_cl), extra]


def test_long_document_pages_past_the_window_are_replayed(tmp_root):
    """Official reads a document longer than 64 pages window by window; the replay answers each
    window with its own pages (a page's text lands on that page)."""
    (_, official_cl), _ = outputs("synthetic/long_document", "2509", tmp_root)
    items = json.loads(official_cl)
    opened = {i["page_idx"]: i["text"] for i in items if i["type"] == "text" and i["text"].endswith("opens.")}
    assert opened[0] == "Page 0 opens." and opened[64] == "Page 64 opens." and opened[65] == "Page 65 opens."


# Pieces of table cell markup: references, attributes, void and stray tags, special strings,
# whitespace runs, script and ruby text, formulas, full-width text.
HTML_TOKENS = [
    "<td>", "</td>", "<tr>", "</tr>", "<table>", "</table>", "<br>", "</br>", "<br/>", "<b>", "</b>", " ", "\n", "x",
    "Ａ", "&amp;", "&#39;", "&quot;", "&lt;", "<", ">", "&", "'", '"', '<td colspan="2">',
    "<th rowspan=3 class=' a b '>", "<!--c-->", "<pre>", "</pre>", "<eq>", "</eq>", "&nbsp;", "&zz;",
    "<img src='a\"b'>", "<p>", "\t", "<script>", "</script>", "\\(", "\\)", "１", "＆", "<code>", "</code>",
    "<span class='docvortex-math'>", "</span>", "<rt>",
]  # fmt: skip


def random_markup(rng, n: int) -> str:
    return "".join(rng.choice(HTML_TOKENS) for _ in range(rng.randint(1, n)))


def test_table_normalization_matches_docvortex():
    """Half-width table text, and the table written anew only when it changed, as docvortex does."""
    import random

    from docvortex.content.normalization import _normalize_table as official

    from mineru_fast.results.mineru4 import _normalize_table

    rng = random.Random(1)
    cases = [f"<table><tr>{random_markup(rng, 30)}</tr></table>" for _ in range(600)]
    assert [_normalize_table(c) for c in cases] == [official(c) for c in cases]


def test_table_join_matches_docvortex():
    """Tables split across pages (headers repeated or not, other column counts, column and row
    spans, empty row-span placeholders under spans from the page before, ragged rows, captions
    with and without "continued", footnotes, other widths) join as docvortex joins them, or stay
    apart."""
    import random

    from docvortex.content.table.content import merge_table_content

    from mineru_fast.results.table_merge import merge_tables

    rng = random.Random(2)

    def row(columns: int) -> str:
        cells, column = [], 0
        while column < columns:
            draw = rng.random()
            if draw < 0.15 and column + 1 < columns:
                cells.append(f'<td colspan="2">{rng.choice("ab")}</td>')
                column += 2
                continue
            if draw < 0.25:  # a row span, often an empty placeholder
                cells.append(f'<td rowspan="{rng.choice([2, 3])}">{rng.choice(["", "", "a"])}</td>')
            elif draw >= 0.3:  # else a cell left out: a ragged row
                cells.append(f"<td>{rng.choice(['a', 'b', 'Ａ', '1'])}</td>")
            column += 1
        return "<tr>" + "".join(cells) + "</tr>"

    def table(columns: int, right: float, caption: str | None, footnote: bool) -> dict:
        rows = ["<tr>" + "".join(f"<td>h{c}</td>" for c in range(columns)) + "</tr>"] if rng.random() < 0.6 else []
        body = "<table>" + "".join(rows + [row(columns) for _ in range(rng.randint(1, 3))]) + "</table>"
        children = [{"type": "table_body", "bbox": [0.1, 0.05, right, 0.4], "content": body, "index": 1}]
        if caption:
            spans = [{"type": "text", "content": caption}]
            children.insert(0, {"type": "table_caption", "bbox": [0.1, 0.01, 0.5, 0.03], "content": spans, "index": 0})
        if footnote:
            spans = [{"type": "text", "content": "note"}]
            children.append({"type": "table_footnote", "bbox": [0.1, 0.41, 0.5, 0.43], "content": spans, "index": 2})
        return {"type": "table", "bbox": [0.1, 0.05, right, 0.4], "content": children, "index": 1}

    joined = 0
    for _ in range(2000):
        previous = table(rng.choice([2, 3]), 0.9, rng.choice([None, "Table 1"]), rng.random() < 0.2)
        caption = rng.choice([None, None, "Table 1 (continued)", "Table 2"])
        current = table(rng.choice([2, 3]), rng.choice([0.9, 0.9, 0.88, 0.6]), caption, rng.random() < 0.2)
        official, fast = merge_table_content(previous, current), merge_tables(previous, current)
        assert (official is None) == (fast is None), (previous, current)
        if official is not None and fast is not None:
            joined += 1
            shape = [(c["type"], c.get("index"), c["content"]) for c in official["content"]]
            assert shape == [(c["type"], c.get("index"), c["content"]) for c in fast["content"]]
    assert joined > 50  # the cases exercise the join, not only its refusals


# Inline markup a simple table's cells may hold: every tag official renders (alone, nested and
# unclosed), links with and without targets and with characters their targets escape, code with
# backticks, formulas with pipes, comments, whitespace, characters cell text escapes.
CELL_TOKENS = [
    "<b>", "</b>", "<strong>", "</strong>", "<i>", "</i>", "<em>", "</em>", "<u>", "</u>", "<s>", "</s>",
    "<sup>", "</sup>", "<sub>", "</sub>", "<code>", "</code>", "<p>", "</p>", "<span>", "</span>", "<br>",
    '<a href="http://e.x/a b(1)|ü\\\\">', "<a href=''>", "<a>", '<a href=" /x ">', "</a>", "<eq>", "</eq>",
    "<!--c-->", "x", "y z", " ", "  ", "\t", "\n", "|", "\\", "&amp;", "&lt;", "<", "`", "``", "*", "_", "~",
    "Ａ", "１", "é",
]  # fmt: skip


def test_table_cells_inline_markup_matches_docvortex():
    """Simple tables whose cells hold random inline markup render as docvortex renders them:
    emphasis markers or HTML tags by style set, code spans, links (Markdown or HTML), escaping."""
    import random

    from docvortex.options import LatexDelimitersConfig
    from docvortex.render._internal.markdown.table import render_html_table

    from mineru_fast.results.table_markdown import render_table

    rng = random.Random(3)

    def cell() -> str:
        tag = rng.choice(["td", "td", "th"])
        return f"<{tag}>{''.join(rng.choice(CELL_TOKENS) for _ in range(rng.randint(0, 12)))}</{tag}>"

    def row() -> str:
        return "<tr>" + "".join(cell() for _ in range(rng.randint(1, 3))) + "</tr>"

    cases = ["<table>" + row() + row() + row() + "</table>" for _ in range(1500)]
    official = [render_html_table(c, asset_base_url="", delimiters=LatexDelimitersConfig()) for c in cases]
    assert [render_table(c) for c in cases] == official
    pipe_tables = [o for o in official if o is not None and o.startswith("| ")]
    links = sum("[" in o and "](" in o for o in pipe_tables)
    assert len(pipe_tables) > 300 and links > 30  # pipe tables with links rendered, not only tables refused
