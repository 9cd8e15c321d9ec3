"""A PDF page's text layer as characters with boxes in the displayed page's frame.

PDFium (pypdfium2) reads the characters in content order. Boxes are PDFium's loose boxes (font
ascent to descent, so every glyph of one font at one size has the same height, which is what line
grouping and superscript detection need), mapped through the page's display transform (crop box
and ``/Rotate``) and normalized to 0..1 with y pointing down, the same frame as the rendered page
image and the layout boxes.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["PdfChar", "PageText", "read_page_text", "hidden_char", "white_char"]

Box = tuple[float, float, float, float]
_DEVICE = 1_000_000  # device size used to read PDFium's display transform (integer outputs)
_UNPAINTED = (3, 7)  # text render modes that paint nothing: invisible, clip only (PDF 32000-1 9.3.6)
_FILLED = (0, 2, 4, 6)  # render modes whose glyphs are filled (fill, fill+stroke, and with clip)
_WHITE = 250  # fill components (0..255) from which a filled glyph counts as white on the page


@dataclass(frozen=True)
class PdfChar:
    """One character of the text layer.

    Attributes:
        text: the character (surrogate pairs joined; PDFium's code 0 kept as "\\x00").
        bbox: loose box ``(x0, y0, x1, y1)`` normalized to the displayed page.
        generated: PDFium made it up (a space between words or a line break), not the file.
        map_error: PDFium could not map the glyph to Unicode (``text`` is then a guess).
        angle: rotation of the glyph's baseline on the displayed page in whole degrees (0 =
            horizontal, left to right), PDFium's char angle plus the page's ``/Rotate``.
        hidden: nothing of it is painted (``hidden_char``): a reader sees nothing there, so a
            block's text leaves it out.
        white: filled in white (``white_char``): unseen on a white page, seen on a dark fill, so
            a block holding such text is read from its image rather than trusted or dropped.
    """

    text: str
    bbox: Box
    generated: bool = False
    map_error: bool = False
    angle: int = 0
    hidden: bool = False
    white: bool = False


@dataclass
class PageText:
    """The text layer of one page.

    Attributes:
        chars: characters in PDFium's content order.
        size: displayed page size ``(width, height)`` in points.
        image_coverage: share of the page's area covered by image objects (0..1, overlaps counted
            once per object, capped at 1).
        char_count: PDFium's character count, generated characters included.
    """

    chars: list[PdfChar] = field(default_factory=list)
    size: tuple[float, float] = (0.0, 0.0)
    image_coverage: float = 0.0
    char_count: int = 0

    @cached_property
    def centers(self) -> np.ndarray:
        """Centres of the characters' boxes, float ``[len(chars), 2]`` (x, y), normalized."""
        boxes = np.array([c.bbox for c in self.chars], dtype=np.float64).reshape(-1, 4)
        return (boxes[:, :2] + boxes[:, 2:]) / 2

    def indices_in(self, bbox: tuple[float, float, float, float]) -> list[int]:
        """Indices of the characters whose centre lies inside ``bbox`` (edges included)."""
        c = self.centers
        hit = (c[:, 0] >= bbox[0]) & (c[:, 0] <= bbox[2]) & (c[:, 1] >= bbox[1]) & (c[:, 1] <= bbox[3])
        return np.flatnonzero(hit).tolist()


def _display_transform(page) -> tuple[float, float, float, float, float, float]:
    """Affine map from PDF user space to the displayed page normalized to 0..1 (y down)."""
    import pypdfium2.raw as pdfium_c

    def to_device(x: float, y: float) -> tuple[float, float]:
        dx, dy = ctypes.c_int(), ctypes.c_int()
        pdfium_c.FPDF_PageToDevice(page, 0, 0, _DEVICE, _DEVICE, 0, x, y, dx, dy)
        return dx.value / _DEVICE, dy.value / _DEVICE

    ox, oy = to_device(0.0, 0.0)
    ax, ay = to_device(1000.0, 0.0)
    bx, by = to_device(0.0, 1000.0)
    return (ax - ox) / 1000.0, (bx - ox) / 1000.0, ox, (ay - oy) / 1000.0, (by - oy) / 1000.0, oy


def _image_coverage(page, width: float, height: float) -> float:
    import pypdfium2.raw as pdfium_c

    area = 0.0
    for obj in page.get_objects(filter=[pdfium_c.FPDF_PAGEOBJ_IMAGE], max_depth=3):
        left, bottom, right, top = obj.get_bounds()
        area += max(0.0, right - left) * max(0.0, top - bottom)
    page_area = width * height
    return min(area / page_area, 1.0) if page_area > 0 else 0.0


def hidden_char(textpage, index: int) -> bool:
    """Whether PDFium's character ``index`` paints nothing: its text render mode is invisible (3,
    as OCR layers over scans use) or clip-only (7), or its fill is fully transparent. Generated
    characters (spaces, line breaks) have no text object and are not hidden."""
    mode, fill = _paint(textpage, index)
    return mode in _UNPAINTED or (fill is not None and fill[3] == 0)


def white_char(textpage, index: int) -> bool:
    """Whether PDFium's character ``index`` is filled opaque white (components >= 250 of 255): on
    the white page it hides text, on a dark banner or cell it is the text, and the page's colour
    under it is not known here."""
    mode, fill = _paint(textpage, index)
    return mode not in _UNPAINTED and fill is not None and fill[3] != 0 and min(fill[:3]) >= _WHITE


def _paint(textpage, index: int) -> tuple[int | None, tuple[int, int, int, int] | None]:
    """The text render mode of character ``index`` and its fill colour (RGBA) where it is filled."""
    import ctypes

    import pypdfium2.raw as pdfium_c

    obj = pdfium_c.FPDFText_GetTextObject(textpage, index)
    if not obj:
        return None, None
    mode = pdfium_c.FPDFTextObj_GetTextRenderMode(obj)
    r, g, b, a = (ctypes.c_uint() for _ in range(4))
    if mode not in _FILLED or not pdfium_c.FPDFText_GetFillColor(textpage, index, r, g, b, a):
        return mode, None
    return mode, (r.value, g.value, b.value, a.value)


def read_page_text(page) -> PageText:
    """Read one page's text layer. The caller holds the PDFium lock (PDFium is not thread-safe).

    Args:
        page: a ``pypdfium2.PdfPage``.

    Returns:
        The page's characters and image coverage.
    """
    import pypdfium2.raw as pdfium_c

    width, height = page.get_size()
    rotation = page.get_rotation()
    a, b, c, d, e, f = _display_transform(page)
    textpage = page.get_textpage()
    try:
        count = textpage.count_chars()
        chars: list[PdfChar] = []
        rect = pdfium_c.FS_RECTF()
        pending_high = ""
        for i in range(count):
            code = pdfium_c.FPDFText_GetUnicode(textpage, i)
            if 0xD800 <= code <= 0xDBFF:  # high surrogate: joined with the next character
                pending_high = chr(code)
                continue
            text = (pending_high + chr(code)).encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            pending_high = ""
            if 0xDC00 <= code <= 0xDFFF and len(text) == 1:  # a lone low surrogate
                text = "\ufffd"
            pdfium_c.FPDFText_GetLooseCharBox(textpage, i, rect)
            xs = (a * rect.left + b * rect.top + c, a * rect.right + b * rect.bottom + c)
            ys = (d * rect.left + e * rect.top + f, d * rect.right + e * rect.bottom + f)
            angle = round(pdfium_c.FPDFText_GetCharAngle(textpage, i) * 180 / math.pi + rotation) % 360
            chars.append(
                PdfChar(
                    text,
                    (min(xs), min(ys), max(xs), max(ys)),
                    pdfium_c.FPDFText_IsGenerated(textpage, i) == 1,
                    pdfium_c.FPDFText_HasUnicodeMapError(textpage, i) == 1,
                    angle,
                    hidden_char(textpage, i),
                    white_char(textpage, i),
                )
            )
    finally:
        textpage.close()
    return PageText(chars, (width, height), _image_coverage(page, width, height), count)
