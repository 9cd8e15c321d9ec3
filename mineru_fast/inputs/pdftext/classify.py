"""``ocr_mode="auto"``: is a PDF's text layer trustworthy (``"txt"``) or must the pages be read
from their images (``"ocr"``)?

The document-level decision follows MinerU 4.0.12's classifier (``PDFDocument.classify`` in its
DocVortex dependency, ``docvortex/document/pdf/classify.py``), with its thresholds: up to 10
pages sampled evenly; ``"ocr"`` when a sampled page's aspect ratio exceeds 10, when the sampled
pages average fewer than 50 non-whitespace characters, when 4 % or more of the characters are
ones PDFium could not map to Unicode (a font without a usable ToUnicode map: an Identity CID
font without one is flagged on every character it draws), when at least 300 characters are
present and 3 % or more are NUL, U+FFFD, control or private-use characters, when CJK text is
polluted by the rarely used U+7280..U+72DF block (>= 30 characters, >= 2.6 % of the CJK text) or
by several other scripts (>= 120 characters, >= 18 %), when a page is dense in runs of ASCII
punctuation (>= 25 % punctuation and >= 10 % in runs of 4+ of 2+ kinds, pages of 100+
characters; the look of undecoded glyph codes), or when 80 % or more of the sampled pages are
80 % or more covered by images (scans, including scans under a hidden OCR layer, whose text
cannot be checked against the image). MinerU's two font-dictionary checks (usage counts of
Identity CID fonts without ToUnicode, Type1 fonts with a Latin CharSet decoding as CJK) need a
PDF object parser and are not made; the Unicode-map-error share stands in for the first.

``page_verdict`` applies the same signals (but the minimum character count) to one page of a
``"txt"`` document, so a scanned page inside a born-digital PDF is read from its image (MinerU
decides per document only).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from mineru_fast.inputs.pdftext.chars import PageText, read_page_text

__all__ = ["TextLayerVerdict", "classify_pdf", "page_verdict", "resolve_ocr_mode", "OCR_MODES", "sample_pages"]

OCR_MODES = ("auto", "txt", "ocr")
MAX_SAMPLE_PAGES = 10
MAX_ASPECT_RATIO = 10.0
MIN_CHARS_PER_PAGE = 50
MAX_MAP_ERROR_RATIO = 0.04
MIN_CHARS_FOR_QUALITY = 300
MAX_ABNORMAL_RATIO = 0.03
IMAGE_COVERAGE = 0.8
MAX_CHARS_PER_PAGE = 65535  # MinerU reads pages with more characters than this from the image
_U72XX = (0x7280, 0x72DF)
_U72XX_COMMON = set("犀犁犄犊犒犟犬犯状犷犹狂狄狈狐狗狙狞")
_CJK_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2EBEF))
_OTHER_SCRIPTS = (
    (0x0370, 0x03FF), (0x0400, 0x052F), (0x0600, 0x06FF), (0x0700, 0x074F), (0x0750, 0x077F),
    (0x0780, 0x07BF), (0x07C0, 0x07FF), (0x0800, 0x083F), (0x0840, 0x085F), (0x0860, 0x086F),
    (0x0870, 0x089F), (0x0900, 0x097F), (0x0C80, 0x0CFF), (0x0E00, 0x0E7F), (0x1000, 0x109F),
    (0x1100, 0x11FF), (0x1200, 0x137F), (0x13A0, 0x13FF), (0x1400, 0x167F), (0x1800, 0x18AF),
    (0x1A20, 0x1AAF), (0x2C00, 0x2C5F), (0xA000, 0xA48F),
)  # fmt: skip
_ASCII_PUNCT = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_PUNCT_RUN = re.compile(r"[!-/:-@\[-`{-~]{4,}")


@dataclass(frozen=True)
class TextLayerVerdict:
    """``mode`` is ``"txt"`` or ``"ocr"``; ``reason`` says which check decided (for logs)."""

    mode: str
    reason: str


@dataclass
class _Counts:
    chars: int = 0
    visible: int = 0  # non-whitespace characters of the file (not generated)
    map_errors: int = 0
    abnormal: int = 0
    cjk: int = 0
    u72xx: int = 0
    other_scripts: int = 0
    dense_scripts: int = 0
    punct_page: bool = False

    def add(self, other: _Counts) -> None:
        for name in ("chars", "visible", "map_errors", "abnormal", "cjk", "u72xx", "other_scripts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.punct_page = self.punct_page or other.punct_page


def _in(code: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(lo <= code <= hi for lo, hi in ranges)


def _abnormal(text: str) -> bool:
    code = ord(text[0]) if text else 0
    control = (code < 32 or 127 <= code <= 159) and code not in (9, 10, 13)
    return code == 0 or code == 0xFFFD or control or 0xE000 <= code <= 0xF8FF


def _counts(page: PageText) -> _Counts:
    counts = _Counts(chars=page.char_count)
    visible: list[str] = []
    per_script: dict[int, int] = {}
    for char in page.chars:
        counts.map_errors += char.map_error
        counts.abnormal += _abnormal(char.text)
        if char.generated or char.text.isspace():
            continue
        visible.append(char.text)
        code = ord(char.text[0])
        counts.cjk += _in(code, _CJK_RANGES)
        counts.u72xx += _U72XX[0] <= code <= _U72XX[1] and char.text not in _U72XX_COMMON
        for i, (lo, hi) in enumerate(_OTHER_SCRIPTS):
            if lo <= code <= hi:
                counts.other_scripts += 1
                per_script[i] = per_script.get(i, 0) + 1
    counts.visible = len(visible)
    counts.dense_scripts = sum(n >= 5 for n in per_script.values())
    text = "".join(visible)
    if len(text) >= 100:
        punct = sum(ch in _ASCII_PUNCT for ch in text)
        runs = sum(len(m.group()) for m in _PUNCT_RUN.finditer(text) if len(set(m.group())) >= 2)
        counts.punct_page = punct / len(text) >= 0.25 and runs / len(text) >= 0.10
    return counts


def _verdict(counts: _Counts, pages: int, covered_pages: int, min_chars: bool = True) -> TextLayerVerdict:
    if min_chars and counts.visible / max(pages, 1) < MIN_CHARS_PER_PAGE:
        return TextLayerVerdict("ocr", f"fewer than {MIN_CHARS_PER_PAGE} characters per page")
    if counts.chars and counts.map_errors / counts.chars >= MAX_MAP_ERROR_RATIO:
        return TextLayerVerdict("ocr", f"{counts.map_errors} of {counts.chars} characters have no Unicode mapping")
    if counts.chars >= MIN_CHARS_FOR_QUALITY and counts.abnormal / counts.chars >= MAX_ABNORMAL_RATIO:
        return TextLayerVerdict("ocr", f"{counts.abnormal} NUL, U+FFFD, control or private-use characters")
    if counts.u72xx >= 30 and counts.cjk and counts.u72xx / counts.cjk >= 0.026:
        return TextLayerVerdict("ocr", "CJK text polluted by U+7280..U+72DF")
    if (
        counts.visible >= 300
        and counts.cjk >= 100
        and counts.other_scripts >= 120
        and counts.other_scripts / counts.visible >= 0.18
        and counts.dense_scripts >= 3
    ):
        return TextLayerVerdict("ocr", "CJK text mixed with several unrelated scripts")
    if counts.punct_page:
        return TextLayerVerdict("ocr", "runs of ASCII punctuation (undecoded glyph codes)")
    if pages and covered_pages / pages >= IMAGE_COVERAGE:
        return TextLayerVerdict("ocr", "pages covered by images (scans)")
    return TextLayerVerdict("txt", "text layer passes every check")


def sample_pages(page_count: int, max_pages: int = MAX_SAMPLE_PAGES) -> list[int]:
    """Up to ``max_pages`` page indices spread evenly over the document, first and last included."""
    if page_count <= max_pages:
        return list(range(page_count))
    picked = sorted({round(i * (page_count - 1) / (max_pages - 1)) for i in range(max_pages)})
    rest = (i for i in range(page_count) if i not in picked)
    while len(picked) < max_pages:
        picked.append(next(rest))
    return sorted(picked)


def classify_pdf(pdf) -> TextLayerVerdict:
    """Decide ``"txt"`` or ``"ocr"`` for a whole PDF. The caller holds the PDFium lock.

    Args:
        pdf: an open ``pypdfium2.PdfDocument``.

    Returns:
        The verdict and the check that decided it.
    """
    indices = sample_pages(len(pdf))
    if not indices:
        return TextLayerVerdict("ocr", "no pages")
    total, covered = _Counts(), 0
    for index in indices:
        page = pdf[index]
        try:
            width, height = page.get_size()
            if min(width, height) <= 0 or max(width / height, height / width) > MAX_ASPECT_RATIO:
                return TextLayerVerdict("ocr", f"page {index + 1} has an extreme aspect ratio")
            text = read_page_text(page)
        finally:
            page.close()
        total.add(_counts(text))
        covered += text.image_coverage >= IMAGE_COVERAGE
    return _verdict(total, len(indices), covered)


def page_verdict(page: PageText) -> TextLayerVerdict:
    """The same checks on one page of a ``"txt"`` document (a scan among born-digital pages, a
    page with a broken font), except the minimum character count: a page with little text and no
    page-sized image stays ``"txt"`` (its blocks without PDF text are read from the image anyway).
    A page with more characters than MinerU reads from a text layer (65535) is ``"ocr"``."""
    if page.char_count > MAX_CHARS_PER_PAGE:
        return TextLayerVerdict("ocr", f"more than {MAX_CHARS_PER_PAGE} characters")
    return _verdict(_counts(page), 1, page.image_coverage >= IMAGE_COVERAGE, min_chars=False)


def resolve_ocr_mode(ocr_mode: str, pdf=None) -> TextLayerVerdict:
    """The document's mode for a requested ``ocr_mode``.

    Args:
        ocr_mode: ``"auto"``, ``"txt"`` or ``"ocr"``.
        pdf: the open ``pypdfium2.PdfDocument``, or None for image inputs (always ``"ocr"``).

    Raises:
        ValueError: unknown ``ocr_mode``.
    """
    if ocr_mode not in OCR_MODES:
        raise ValueError(f"ocr_mode must be one of {OCR_MODES}, got {ocr_mode!r}")
    if pdf is None:
        return TextLayerVerdict("ocr", "an image has no text layer")
    if ocr_mode != "auto":
        return TextLayerVerdict(ocr_mode, "requested")
    return classify_pdf(pdf)
