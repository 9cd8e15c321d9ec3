"""Synthetic documents made here, so tests do not depend on third-party files."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image, ImageDraw, ImageFont


def text_page(size: tuple[int, int] = (850, 1100), lines: int = 12, seed: int = 0) -> Image.Image:
    """A white page with a title, lines of black text and a ruled table."""
    page = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=24)
    draw.text((60, 50), f"Synthetic page {seed}", fill="black", font=ImageFont.load_default(size=40))
    for i in range(lines):
        draw.text((60, 130 + 34 * i), f"Line {i} of sample text number {seed * 100 + i}.", fill="black", font=font)
    top = 150 + 34 * lines
    for r in range(4):
        draw.line((60, top + 40 * r, 600, top + 40 * r), fill="black", width=2)
    return page


def pdf_bytes(n_pages: int = 2) -> bytes:
    """An image-only PDF (Pillow's writer) of ``n_pages`` synthetic pages."""
    pages = [text_page(seed=i) for i in range(n_pages)]
    buf = io.BytesIO()
    pages[0].save(buf, format="PDF", save_all=True, append_images=pages[1:], resolution=100.0)
    return buf.getvalue()


def image_bytes(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


SAMPLE_LAYOUT = (
    "<|box_start|>100 080 900 140<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>\n"
    "<|box_start|>100 180 900 420<|box_end|><|ref_start|>text<|ref_end|><|rotate_up|>\n"
    "<|box_start|>100 460 900 820<|box_end|><|ref_start|>image<|ref_end|><|rotate_up|>\n"
    "<|box_start|>100 840 900 900<|box_end|><|ref_start|>image_caption<|ref_end|><|rotate_up|>"
)
SAMPLE_CONTENTS = ["A replayed title", "A replayed paragraph of body text.", None, "Figure 1: a caption."]


def sample_trace(n_pages: int):
    """A replay trace giving every page the same four blocks (title, text, image, caption)."""
    from mineru_fast.protocol.traces import PageTrace, Trace

    return Trace([PageTrace(SAMPLE_LAYOUT, list(SAMPLE_CONTENTS)) for _ in range(n_pages)])


def hidden_text_pdf(visible: str, hidden: str, white: str) -> bytes:
    """One page with a visible line, an invisible one (render mode 3) on top of it and a white one
    (fill 255,255,255) just below, in the same text block."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    pdf = pdfium.PdfDocument.new()
    font = pdfium_c.FPDFText_LoadStandardFont(pdf, b"Helvetica")
    page = pdf.new_page(612, 792)
    _pdfium_text(pdf, page, font, 12, 72, 700, visible)
    _pdfium_text(pdf, page, font, 12, 72, 700, hidden, pdfium_c.FPDF_TEXTRENDERMODE_INVISIBLE)
    _pdfium_text(pdf, page, font, 12, 72, 686, white, fill=(255, 255, 255, 255))
    page.gen_content()
    return _saved(pdf)


def claimed_pages_pdf(count: int) -> bytes:
    """A PDF of one real page whose page tree claims ``count`` pages (a few hundred bytes; PDFium
    reports ``count`` pages, the others fail to load)."""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count %d >>" % count,
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>",
    ]
    return raw_pdf(objects)


def no_pages_pdf() -> bytes:
    """A well-formed PDF whose page tree is empty (PDFium loads it; it has 0 pages)."""
    return raw_pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])


def encrypted_pdf(password: str) -> bytes:
    """A one-page blank PDF encrypted with user ``password`` (pypdf, RC4 128-bit). Skips the
    calling test when pypdf (the dev extra) is not installed."""
    import pytest

    pypdf = pytest.importorskip("pypdf", reason="pypdf (the dev extra) encrypts the PDF")
    writer = pypdf.PdfWriter()
    writer.add_blank_page(612, 792)
    writer.encrypt(password)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def tiff_with_frame_size(frames: list[Image.Image], index: int, size: tuple[int, int], **kwargs: object) -> bytes:
    """A multi-frame TIFF of ``frames`` whose frame ``index`` header claims ``size`` (width, height).

    Only the ImageWidth/ImageLength tags change, so the file stays a few KB however large the
    claimed frame is (its pixel data is the small original's: decoding it would fail).
    """
    data = bytearray(image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:], **kwargs))
    order = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(order + "I", data, 4)
    for _ in range(index):
        (count,) = struct.unpack_from(order + "H", data, ifd)
        (ifd,) = struct.unpack_from(order + "I", data, ifd + 2 + 12 * count)
    (count,) = struct.unpack_from(order + "H", data, ifd)
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        tag, kind = struct.unpack_from(order + "HH", data, entry)
        if tag in (256, 257):  # ImageWidth, ImageLength
            value = size[0] if tag == 256 else size[1]
            fmt = order + ("H" if kind == 3 else "I")
            struct.pack_into(fmt, data, entry + 8, value)
    return bytes(data)


def blank_png(width: int, height: int) -> bytes:
    """A fully transparent RGBA PNG of any size, made row by row (never held decoded in memory).

    A 12000x12000 image is about 0.6 MB of file and 576 MB once decoded.
    """
    row = bytes(1 + 4 * width)  # filter byte 0, then transparent black pixels
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _pdfium_text(
    pdf, page, font, size: float, x: float, y: float, text: str, mode: int | None = None, fill: tuple | None = None
) -> None:
    """Draw ``text`` with its baseline at (x, y) points (PDF user space, origin bottom left), with
    text render ``mode`` and ``fill`` colour ``(r, g, b, a)`` when given."""
    import ctypes

    import pypdfium2.raw as pdfium_c

    obj = pdfium_c.FPDFPageObj_CreateTextObj(pdf, font, size)
    wide = ctypes.create_string_buffer((text + "\0").encode("utf-16-le"))
    pdfium_c.FPDFText_SetText(obj, ctypes.cast(wide, ctypes.POINTER(pdfium_c.FPDF_WCHAR)))
    if mode is not None:
        pdfium_c.FPDFTextObj_SetTextRenderMode(obj, mode)
    if fill is not None:
        pdfium_c.FPDFPageObj_SetFillColor(obj, *fill)
    pdfium_c.FPDFPageObj_Transform(obj, 1, 0, 0, 1, x, y)
    pdfium_c.FPDFPage_InsertObject(page, obj)


def _saved(pdf) -> bytes:
    buf = io.BytesIO()
    pdf.save(buf)
    return buf.getvalue()


def born_digital_pdf(pages: list[list[tuple[float, float, float, str]]], size: tuple[int, int] = (612, 792)) -> bytes:
    """A PDF with a real text layer (Helvetica), written by PDFium.

    Args:
        pages: per page, runs ``(x, y, font_size, text)`` with (x, y) the baseline start in points
            from the top left of the page.
        size: page size in points.
    """
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    pdf = pdfium.PdfDocument.new()
    font = pdfium_c.FPDFText_LoadStandardFont(pdf, b"Helvetica")
    for runs in pages:
        page = pdf.new_page(*size)
        for x, y, font_size, text in runs:
            _pdfium_text(pdf, page, font, font_size, x, size[1] - y, text)
        page.gen_content()
    return _saved(pdf)


def cid_font_without_tounicode_pdf(lines: int = 30) -> bytes:
    """A PDF whose text is drawn with an embedded Identity-H CID font (DejaVu Sans) and no
    ToUnicode map, so the glyph codes cannot be turned back into text: PDFium writes the font,
    pypdf removes its /ToUnicode entry. Skips the calling test when DejaVu Sans is not installed."""
    import ctypes
    import random
    from pathlib import Path

    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c
    import pytest

    pypdf = pytest.importorskip("pypdf", reason="pypdf (the dev extra) removes the ToUnicode map")
    font_path = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
    if not font_path.is_file():
        pytest.skip(f"{font_path} not installed (a TrueType font to embed)")
    font = font_path.read_bytes()
    cid_to_gid = b"".join(cid.to_bytes(2, "big") for cid in range(4096))  # CID k draws glyph k
    # PDFium insists on a ToUnicode CMap; this one maps nothing and is removed below.
    cmap = b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /None def endcmap end end\0"
    pdf = pdfium.PdfDocument.new()
    handle = pdfium_c.FPDFText_LoadCidType2Font(
        pdf,
        (ctypes.c_uint8 * len(font)).from_buffer_copy(font),
        len(font),
        cmap,
        (ctypes.c_uint8 * len(cid_to_gid)).from_buffer_copy(cid_to_gid),
        len(cid_to_gid),
    )
    page = pdf.new_page(612, 792)
    rng = random.Random(0)
    for line in range(lines):
        obj = pdfium_c.FPDFPageObj_CreateTextObj(pdf, handle, 11.0)
        codes = [rng.randint(36, 90) for _ in range(60)]  # glyph ids of letters in DejaVu Sans
        pdfium_c.FPDFText_SetCharcodes(obj, (ctypes.c_uint32 * len(codes))(*codes), len(codes))
        pdfium_c.FPDFPageObj_Transform(obj, 1, 0, 0, 1, 50, 740 - 22 * line)
        pdfium_c.FPDFPage_InsertObject(page, obj)
    page.gen_content()
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(_saved(pdf))))
    for pdf_page in writer.pages:
        for ref in pdf_page["/Resources"]["/Font"].values():
            ref.get_object().pop("/ToUnicode", None)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def scan_with_hidden_text_pdf(n_pages: int = 2) -> bytes:
    """Pages that are one full-page image each, under an invisible text layer (render mode 3)
    that says something else than the image, as a bad OCR layer would."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    pdf = pdfium.PdfDocument.new()
    font = pdfium_c.FPDFText_LoadStandardFont(pdf, b"Helvetica")
    for i in range(n_pages):
        page = pdf.new_page(612, 792)
        image = pdfium.PdfImage.new(pdf)
        image.set_bitmap(pdfium.PdfBitmap.from_pil(text_page(size=(612, 792), seed=i)))
        image.set_matrix(pdfium.PdfMatrix().scale(612, 792))
        page.insert_obj(image)
        for line in range(20):
            text = f"hidden words that do not match the image, line {line}"
            _pdfium_text(pdf, page, font, 11, 72, 700 - 14 * line, text, pdfium_c.FPDF_TEXTRENDERMODE_INVISIBLE)
        page.gen_content()
    return _saved(pdf)


def stroked_lines_pdf(lines_per_page: list[int]) -> bytes:
    """A Letter PDF whose page ``i`` strokes ``lines_per_page[i]`` long diagonal lines (raw PDF
    objects). The content streams repeat one line, so they compress about 400-fold (a million lines:
    64 KB), while PDFium rasterizes each: about 4.4 s per 20,000 lines at 200 DPI on this
    project's 2-core machine (a render-time bomb)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(lines_per_page))).encode()
    objects.append(b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(lines_per_page)))
    for i, lines in enumerate(lines_per_page):
        stream = zlib.compress(b"0.5 w 10 10 m 600 780 l S\n" * lines, 9)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R >>" % (4 + 2 * i))
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(stream), stream))
    return raw_pdf(objects)


def raw_pdf(objects: list[bytes]) -> bytes:
    """A PDF of ``objects`` (object 1 the catalog) with its cross-reference table and trailer."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)
