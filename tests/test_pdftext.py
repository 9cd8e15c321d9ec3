"""The PDF text layer: ``ocr_mode="auto"`` on real and made-up PDFs, and block text assembly."""

from __future__ import annotations

import pypdfium2 as pdfium
import pytest
from conftest import CORPUS, need
from samples import born_digital_pdf, cid_font_without_tounicode_pdf, pdf_bytes, scan_with_hidden_text_pdf

from mineru_fast.inputs.pdftext import (
    BlockText,
    PageText,
    PdfChar,
    block_text,
    classify_pdf,
    merge_lines,
    page_verdict,
    read_page_text,
    resolve_ocr_mode,
)
from mineru_fast.inputs.pdftext.assemble import _clean
from mineru_fast.inputs.pdftext.classify import sample_pages

BORN_DIGITAL = [
    "academic_fig_eq_table_1p.pdf",
    "academic_tableformer_10p.pdf",
    "multicolumn_2col_latex.pdf",
    "zh_financial_research_report_4p.pdf",
    "slides_table_3p_rotate270.pdf",
]
SCANS = ["scanned_zh_book_8p.pdf", "rotated_scan_rotate270.pdf"]

LINES = [
    (72, 72, 18, "A Title"),
    (72, 110, 11, "The quick brown fox jumps over the lazy"),
    (72, 124, 11, "dog. A sentence broken by a hy-"),
    (72, 138, 11, "phen, then the GLGE-"),
    (72, 152, 11, "difficult case and E = mc"),
    (192, 148, 7, "2"),  # raised and smaller: a superscript
    (72, 166, 11, "with water H"),
    (132.6, 169, 7, "2"),  # lowered and smaller: a subscript
    (136.6, 166, 11, "O."),
    (320, 110, 11, "Right column text"),
]


@pytest.fixture(scope="module")
def page() -> PageText:
    pdf = pdfium.PdfDocument(born_digital_pdf([LINES]))
    return read_page_text(pdf[0])


@pytest.mark.parametrize("name", BORN_DIGITAL)
def test_auto_picks_txt_for_born_digital_corpus_pdfs(name):
    pdf = pdfium.PdfDocument(need(CORPUS / name).read_bytes())
    assert classify_pdf(pdf).mode == "txt"


@pytest.mark.parametrize("name", SCANS)
def test_auto_picks_ocr_for_scanned_corpus_pdfs(name):
    pdf = pdfium.PdfDocument(need(CORPUS / name).read_bytes())
    verdict = classify_pdf(pdf)
    assert verdict == resolve_ocr_mode("auto", pdf)
    assert (verdict.mode, verdict.reason) == ("ocr", "fewer than 50 characters per page")


def test_auto_picks_ocr_for_a_cid_font_without_tounicode():
    data = cid_font_without_tounicode_pdf()
    assert b"/ToUnicode" not in data and b"/Identity-H" in data
    verdict = classify_pdf(pdfium.PdfDocument(data))
    assert verdict.mode == "ocr" and "no Unicode mapping" in verdict.reason


def test_auto_picks_ocr_for_a_scan_under_a_hidden_text_layer():
    pdf = pdfium.PdfDocument(scan_with_hidden_text_pdf())
    text = read_page_text(pdf[0])
    assert text.image_coverage == 1.0 and len(text.chars) > 500  # the hidden layer is there ...
    assert classify_pdf(pdf) == resolve_ocr_mode("auto", pdf)
    assert classify_pdf(pdf).reason == "pages covered by images (scans)"  # ... and not trusted


def test_auto_picks_ocr_for_an_image_only_pdf_and_txt_for_a_text_pdf():
    assert classify_pdf(pdfium.PdfDocument(pdf_bytes(2))).mode == "ocr"
    assert classify_pdf(pdfium.PdfDocument(born_digital_pdf([LINES, LINES]))).mode == "txt"


def test_requested_modes_and_images():
    pdf = pdfium.PdfDocument(pdf_bytes(1))
    assert resolve_ocr_mode("txt", pdf).mode == "txt" and resolve_ocr_mode("ocr", pdf).mode == "ocr"
    assert resolve_ocr_mode("txt", None).mode == "ocr"  # an image has no text layer
    with pytest.raises(ValueError, match="ocr_mode"):
        resolve_ocr_mode("text", pdf)


def test_sampled_pages_spread_over_the_document():
    assert sample_pages(3) == [0, 1, 2]
    assert sample_pages(100) == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]
    assert sample_pages(0) == []


def _chars(text: str, **flags) -> list[PdfChar]:
    return [PdfChar(ch, (0.01 * i, 0.1, 0.01 * i + 0.01, 0.12), **flags) for i, ch in enumerate(text)]


def test_page_verdict_flags_scanned_and_garbled_pages_of_a_text_document(page):
    assert page_verdict(page).mode == "txt"
    scan = PageText([], (612, 792), image_coverage=0.95, char_count=0)
    assert page_verdict(scan).reason == "pages covered by images (scans)"
    assert page_verdict(PageText([], (612, 792))).mode == "txt"  # blank page: nothing to read either way
    assert page_verdict(PageText(_chars("Figure 3"), (612, 792))).mode == "txt"  # little text is not a scan
    garbled = PageText(_chars("x" * 100, map_error=True), (612, 792), char_count=100)
    assert page_verdict(garbled).reason == "100 of 100 characters have no Unicode mapping"
    private = PageText(_chars("\ue001" * 20 + "a" * 300), (612, 792), char_count=320)
    assert page_verdict(private).mode == "ocr"
    huge = PageText(_chars("a" * 60), (612, 792), char_count=70_000)
    assert page_verdict(huge).mode == "ocr"


def test_block_text_reads_lines_in_order_with_hyphenation_and_scripts(page):
    assert block_text(page, (0, 0, 1, 0.12)).text == "A Title"
    body = block_text(page, (0, 0.12, 0.5, 0.3))
    assert body.text == (
        "The quick brown fox jumps over the lazy dog. A sentence broken by a hyphen, then the GLGE-difficult "
        "case and E = mc<sup>2</sup> with water H<sub>2</sub>O."
    )
    assert not body.suspicious
    assert block_text(page, (0.5, 0.12, 1, 0.3)).text == "Right column text"  # the other column only
    assert block_text(page, (0, 0.9, 1, 1)) == BlockText("", (), 0, False)  # an empty region


def test_block_text_takes_each_character_once_and_leaves_formulas_as_placeholders(page):
    first = block_text(page, (0, 0.12, 0.5, 0.3))
    assert block_text(page, (0, 0.12, 0.5, 0.3), skip=set(first.used)).text == ""
    x0 = next(c.bbox[0] for c in page.chars if c.text == "E" and c.bbox[1] > 0.17)
    formula = (x0 - 0.001, 0.17, 0.33, 0.2)  # "E = mc2" as an inline formula region
    with_formula = block_text(page, (0, 0.12, 0.5, 0.3), [None, formula])
    assert with_formula.formulas == (1,)
    assert "case and \\(\x001\x00\\) with water" in with_formula.text


def test_rotated_pages_and_rotated_text(tmp_path):
    slides = pdfium.PdfDocument(need(CORPUS / "slides_table_3p_rotate270.pdf").read_bytes())
    # /Rotate 270: boxes are on the displayed (landscape) page, where the title reads left to right.
    assert block_text(read_page_text(slides[0]), (0.2, 0.0, 0.9, 0.25)).text == "Test Table Slide"
    paper = pdfium.PdfDocument(need(CORPUS / "academic_fig_eq_table_1p.pdf").read_bytes())
    # A table header set vertically (baseline at 270 degrees): PDFium's order, no geometric lines.
    assert block_text(read_page_text(paper[0]), (0.58, 0.56, 0.61, 0.61)).text == "Model"


@pytest.mark.parametrize(
    ("lines", "joined"),
    [
        (["a hy-", "phen"], "a hyphen"),
        (["the GLGE-", "difficult"], "the GLGE-difficult"),  # acronyms keep their hyphen
        (["a non-", "linear map"], "a non-linear map"),  # compound prefixes too
        (["pages 10-", "12"], "pages 10-12"),
        (["see https://exa", "mple.com/x now"], "see https://example.com/x now"),
        (["at https://a.org/", "https://b.org"], "at https://a.org/ https://b.org"),
        (["中文", "文本"], "中文文本"),
        (["a (", "b) c"], "a (b) c"),
        (["end", ", then"], "end, then"),
        (["two", "lines"], "two lines"),
        (["", "  ", "only"], "only"),
    ],
)
def test_merge_lines_follows_mineru_rules(lines, joined):
    assert merge_lines(lines) == joined


def test_ligatures_and_pdfium_line_end_hyphens_become_plain_text():
    assert _clean("ﬁnal eﬀect ﬂow ﬃce ﬄe ﬅ ﬆ hy\x02") == "final effect flow ffice ffle ft st hy-"


def test_private_use_runs_make_a_block_suspicious():
    page = PageText(_chars("ab\ue001\ue002cd"), (612, 792), char_count=6)
    assembled = block_text(page, (0, 0, 1, 1))
    assert assembled.text == "ab\ue001\ue002cd" and assembled.suspicious
    assert not block_text(PageText(_chars("abc\ue001d"), (612, 792)), (0, 0, 1, 1)).suspicious  # one is allowed


def _text_block(lines: int, per_line: int) -> PageText:
    """A block of ``lines`` lines of ``per_line`` characters of words, filling the page."""
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    height, width = 0.8 / lines, 0.9 / per_line
    chars = []
    for line in range(lines):
        top = 0.05 + line * height
        for k in range(per_line):
            box = (0.05 + k * width, top, 0.05 + (k + 0.9) * width, top + 0.8 * height)
            chars.append(PdfChar(words[(line * per_line + k) % len(words)], box))
    return PageText(chars, (612, 792), char_count=len(chars))


def test_block_assembly_is_linear_in_characters(monkeypatch):
    """Assembling a block compared every character with every line found so far and joined lines
    by re-reading the whole text each time: a 39 KB page took 85 s, the 65,535-character cap over
    20 minutes. Counted: line grouping compares each character with a few lines, and each join
    reads a bounded tail."""
    from mineru_fast.inputs.pdftext import assemble

    compared, joined = [0], []
    overlap, join = assemble._vertical_overlap, assemble._join

    def counted_overlap(a, b):
        compared[0] += 1
        return overlap(a, b)

    def counted_join(previous, following):
        joined.append(len(previous))
        return join(previous, following)

    monkeypatch.setattr(assemble, "_vertical_overlap", counted_overlap)
    monkeypatch.setattr(assemble, "_join", counted_join)
    page = _text_block(400, 160)  # 64,000 characters: 400 lines (a quadratic grouping: ~13 M comparisons)
    text = block_text(page, (0.0, 0.0, 1.0, 1.0)).text
    assert compared[0] <= 4 * len(page.chars)
    assert len(joined) == 399 and max(joined) <= assemble.JOIN_CONTEXT  # was the whole text so far: 64 K
    lines = ["".join(c.text for c in page.chars[k : k + 160]).strip() for k in range(0, 64_000, 160)]
    assert text == " ".join(lines)  # words flow from line to line, each line end a space


def test_invisible_text_is_left_out_of_a_block_and_white_text_sends_it_to_the_image():
    """Hidden text (render mode 3, white on white) was taken as the page's text: it landed in the
    output, the visible line interleaved with it. Invisible text is left out; white text may be
    hidden (on the white page) or the words of a dark banner, so its block is read from the image
    rather than trusted or silently shortened."""
    from samples import hidden_text_pdf

    pdf = pdfium.PdfDocument(hidden_text_pdf("Visible words here", "SECRET INSTRUCTIONS", "white payload text"))
    text = read_page_text(pdf[0])
    assert "".join(c.text for c in text.chars if c.hidden and not c.text.isspace()) == "SECRETINSTRUCTIONS"
    assert "".join(c.text for c in text.chars if c.white and not c.text.isspace()) == "whitepayloadtext"
    plain = "".join(c.text for c in text.chars if not (c.hidden or c.white or c.text.isspace()))
    assert plain == "Visiblewordshere"
    first_line = block_text(text, (0.0, 0.0, 1.0, 0.12))  # the visible line and the invisible one over it
    assert (first_line.text, first_line.suspicious) == ("Visible words here", False)
    assert block_text(text, (0.0, 0.0, 1.0, 1.0)).suspicious  # holds the white line: read from the image


def _counted_line_checks(monkeypatch) -> list[int]:
    """Counts the item-to-line comparisons of line grouping (``assemble._vertical_overlap``)."""
    from mineru_fast.inputs.pdftext import assemble

    compared, overlap = [0], assemble._vertical_overlap

    def counted(a, b):
        compared[0] += 1
        return overlap(a, b)

    monkeypatch.setattr(assemble, "_vertical_overlap", counted)
    return compared


def _numbered_lines(count: int, glyph: tuple[float, float]) -> PageText:
    """``count`` short lines "0000", "0001", ... in the top 40 % of the page, then one glyph "W"
    right of them whose box spans ``glyph`` (top, bottom), normalized."""
    pitch = 0.4 / count
    chars = []
    for line in range(count):
        top = 0.03 + line * pitch
        for k, ch in enumerate(f"{line:04d}"):
            chars.append(PdfChar(ch, (0.1 + 0.01 * k, top, 0.109 + 0.01 * k, top + 0.8 * pitch)))
    chars.append(PdfChar("W", (0.2, glyph[0], 0.3, glyph[1])))
    return PageText(chars, (612, 792), char_count=len(chars))


def test_one_tall_glyph_leaves_line_grouping_linear(monkeypatch):
    """Audit round 4, N6: bands of lines were retired against the page's tallest item, so one
    700-pt glyph kept every line in reach of every character (8,000 short lines: 44 s instead of
    0.5 s; here 1.8 M comparisons). Each character is now compared with the lines reaching below
    its own top; the text is the same."""
    compared = _counted_line_checks(monkeypatch)
    page = _numbered_lines(1000, (0.03 + 999 * 0.4 / 1000, 0.98))  # from the last line's top down the page
    text = block_text(page, (0.0, 0.0, 1.0, 1.0)).text
    assert text == " ".join(f"{line:04d}" for line in range(1000)) + " W"  # on the last line, right of it
    assert compared[0] == 3 * 1000 + 1  # a line's first character starts it, the others meet it once; the glyph too
    compared[0] = 0
    middle = _numbered_lines(1000, (0.0, 0.46))  # the audit's case: the glyph's centre among the lines
    assembled = block_text(middle, (0.0, 0.0, 1.0, 1.0))
    assert assembled.chars == 4001 and not assembled.suspicious
    assert compared[0] == 3 * 500 + 1 + 4 * 500  # the lines below its centre join its line: was 1.1 M


def _plain_lines(items: list) -> list[list]:
    """The line-grouping rule without any sweep: each item, in order of its centre's y, joins the
    first band of all whose tallest member it overlaps most, by half its height or more."""
    from mineru_fast.inputs.pdftext.assemble import _vertical_overlap

    bands: list[tuple[tuple, list]] = []
    for item in sorted(items, key=lambda i: (i.bbox[1] + i.bbox[3]) / 2):
        overlaps = [_vertical_overlap(ref, item.bbox) for ref, _ in bands]
        best = max(range(len(bands)), key=overlaps.__getitem__, default=None)
        if best is not None and overlaps[best] >= 0.5:
            ref, members = bands[best]
            members.append(item)
            if item.bbox[3] - item.bbox[1] > ref[3] - ref[1]:
                bands[best] = (item.bbox, members)
        else:
            bands.append((item.bbox, [item]))
    bands.sort(key=lambda band: (band[0][1] + band[0][3]) / 2)
    return [sorted(members, key=lambda i: i.bbox[0]) for _, members in bands]


def test_line_grouping_is_the_plain_rule_for_any_heights():
    """The sweep finds the same lines as comparing each item with every line (the text of normal
    pages is unchanged): random items of text, script, zero, drop-cap and page heights."""
    import random

    from mineru_fast.inputs.pdftext.assemble import _Item, _lines

    rng = random.Random(0)
    for _ in range(300):
        items = []
        for k in range(rng.randint(1, 200)):
            y, x = rng.random(), rng.random()
            height = rng.choice([0.01, 0.012, 0.02, 0.006, 0.0, rng.random() * 0.3, rng.random()])
            items.append(_Item(str(k), (x, y, x + 0.01, y + height)))
        lines = _lines(items, True, 10**9)
        assert lines is not None
        assert [[i.text for i in line] for line in lines] == [[i.text for i in line] for line in _plain_lines(items)]


def test_boxes_stacked_against_the_sweep_are_read_from_the_image_in_bounded_work(monkeypatch):
    """600 page-tall glyphs, each starting one line lower, each join their own line: every glyph
    is compared with all the glyphs before it (180,000 checks for 1,200 characters). The block
    stops at ``MAX_LINE_CHECKS`` checks per character and is read from its image."""
    from mineru_fast.inputs.pdftext.assemble import MAX_LINE_CHECKS

    compared = _counted_line_checks(monkeypatch)
    pitch, chars = 0.05 / 600, []
    for line in range(600):
        top = 0.1 + line * pitch
        chars.append(PdfChar("a", (0.1, top, 0.11, top + 0.8 * pitch)))
        chars.append(PdfChar("B", (0.2 + 0.001 * line, top - 0.1 * pitch, 0.201 + 0.001 * line, top + 0.5)))
    page = PageText(chars, (612, 792), char_count=len(chars))
    assert block_text(page, (0.0, 0.0, 1.0, 1.0)) == BlockText("", (), 1200, True, tuple(range(1200)))
    assert compared[0] == MAX_LINE_CHECKS * 1200
