"""Tier 1: reading documents (synthetic files made here; corpus files where present)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import CORPUS, need
from PIL import Image
from samples import claimed_pages_pdf, image_bytes, pdf_bytes, text_page, tiff_with_frame_size

from mineru_fast.errors import (
    CorruptDocument,
    ImageTooLarge,
    InputError,
    PageRangeError,
    PasswordRequired,
    UnsupportedFormat,
)
from mineru_fast.inputs.documents import MAX_PAGE_RANGE_CHARS, open_document, parse_page_range, to_rgb


def test_page_ranges():
    assert parse_page_range("1-3,5", 10) == [0, 1, 2, 4]
    assert parse_page_range("3,1,3", 4) == [0, 2]
    assert parse_page_range("8-", 10) == [7, 8, 9]
    assert parse_page_range(None, 3) == [0, 1, 2]
    assert parse_page_range("-", 3) == [0, 1, 2] and parse_page_range(" 2 - ", 3) == [1, 2]
    for bad in ("0", "4", "2-1", "a-b", "1,,x", "1,,3", "1-2-3", "+1", "1e3"):
        with pytest.raises(PageRangeError):
            parse_page_range(bad, 3)


def test_a_reversed_page_range_is_called_reversed():
    """``2-1`` was reported as "outside 1-2" although both pages exist."""
    for spec, count in (("2-1", 2), ("5-3", 4), ("9-2", 3)):
        with pytest.raises(PageRangeError) as info:
            parse_page_range(spec, count)
        low, high = spec.split("-")
        assert str(info.value) == f"page range {spec!r} is reversed: write '{high}-{low}'"
    for spec in ("3-0", "7-", "0-2"):  # an end beyond the document or below 1 is outside it
        with pytest.raises(PageRangeError, match=f"page range '{spec}' is outside 1-5"):
            parse_page_range(spec, 5)


def test_long_page_ranges_are_refused_at_once_with_a_short_message():
    """A megabyte of page-range text cost 15 s of CPU and came back whole in the error."""
    many = ",".join(["1-500"] * 2000)  # 11,999 characters, each part the whole document
    assert len(many) > MAX_PAGE_RANGE_CHARS
    with pytest.raises(PageRangeError, match="characters long; the limit is 4,096"):
        parse_page_range(many, 500)
    huge = "9" * 1_000_000
    for spec in (huge, "1," + huge[:3000], "x" * 4000):
        with pytest.raises(PageRangeError) as info:
            parse_page_range(spec, 500)
        assert len(str(info.value)) < 120, str(info.value)[:200]
    under_cap = ",".join(["1-500"] * 680)  # 4,079 characters: merged intervals, each page once
    assert parse_page_range(under_cap, 500) == list(range(500))
    assert parse_page_range("5-7,1-6,9", 10) == [0, 1, 2, 3, 4, 5, 6, 8]


def test_pdf_renders_at_200_dpi_with_page_selection(tmp_path):
    path = tmp_path / "doc.pdf"
    path.write_bytes(pdf_bytes(3))  # 850x1100 px pages at 100 dpi = 612x792 pt
    with open_document(path, pages="2-3") as doc:
        assert (doc.name, doc.format, doc.page_count, doc.page_indices) == ("doc", "pdf", 3, [1, 2])
        page = doc.render(1)
    assert page.mode == "RGB" and page.size == (1700, 2200)


def test_pdf_long_side_is_capped(tmp_path):
    with open_document(pdf_bytes(1), max_side=1000) as doc:
        assert max(doc.render(0).size) == 1000


def test_format_comes_from_content_not_name(tmp_path):
    png_named_pdf = tmp_path / "really_a_png.pdf"
    png_named_pdf.write_bytes(image_bytes(text_page(), "PNG"))
    with open_document(png_named_pdf) as doc:
        assert doc.format == "PNG"


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", CorruptDocument),
        (bytes(range(256)) * 40, UnsupportedFormat),
        (pdf_bytes(1)[:400], CorruptDocument),
    ],
    ids=["zero-bytes", "random-binary", "truncated-pdf"],
)
def test_bad_files_raise_typed_errors(tmp_path, data, error):
    path = tmp_path / "bad.pdf"
    path.write_bytes(data)
    with pytest.raises(error) as info:
        open_document(path)
    assert "bad" in str(info.value)
    assert isinstance(info.value, InputError)


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        open_document(tmp_path / "nope.pdf")


def test_encrypted_pdf_needs_password():
    path = need(CORPUS / "password_required_pw-1234.pdf")
    with pytest.raises(PasswordRequired, match=r"--password \(CLI\), password= \(Python\) or the password form field"):
        open_document(path)
    with pytest.raises(PasswordRequired, match="wrong"):
        open_document(path, password="nope")
    with open_document(path, password="1234") as doc:
        assert doc.page_count == 1
        assert doc.render(0).size == (1700, 2200)


def test_empty_user_password_opens_without_one():
    with open_document(need(CORPUS / "encrypted_aes128_empty_userpw.pdf")) as doc:
        assert doc.page_count == 1


def test_page_rotate_is_honoured():
    with open_document(need(CORPUS / "slides_table_3p_rotate270.pdf")) as doc:
        width, height = doc.render(0).size
    assert width > height  # portrait MediaBox shown landscape


def test_multi_frame_tiff_gives_one_page_per_frame():
    frames = [Image.new("RGB", (60, 40), c) for c in ("red", "green", "blue")]
    data = image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    with open_document(data, pages="2-3") as doc:
        assert doc.page_count == 3
        assert [doc.render(i).getpixel((5, 5)) for i in doc.page_indices] == [(0, 128, 0), (0, 0, 255)]


def _two_frame_tiff(second_size: tuple[int, int]) -> bytes:
    frames = [Image.new("RGB", (60, 40), "red"), Image.new("1", (64, 64), 1)]
    return tiff_with_frame_size(frames, 1, second_size)


def test_every_tiff_frame_is_checked_against_the_pixel_limit_before_it_is_decoded(monkeypatch):
    """Only the first frame was checked: a 20000x20000 second frame reached the decoder."""
    from PIL import TiffImagePlugin

    decoded = []
    load = TiffImagePlugin.TiffImageFile.load
    monkeypatch.setattr(TiffImagePlugin.TiffImageFile, "load", lambda self: decoded.append(self.tell()) or load(self))
    with open_document(_two_frame_tiff((20000, 20000))) as doc:
        assert (doc.page_count, doc.page_indices) == (2, [0, 1])
        with pytest.raises(ImageTooLarge, match="frame 2 is 20000x20000 pixels, over the limit of 150,000,000"):
            doc.render(1)
        with pytest.raises(ImageTooLarge, match="frame 2"):
            doc.page_size(1)
        assert doc.render(0).getpixel((0, 0)) == (255, 0, 0)  # back on frame 1 after frame 2's header
    assert 1 not in decoded and 0 in decoded
    with open_document(_two_frame_tiff((64, 64)), max_pixels=3000) as doc:  # the option, not only the default
        assert doc.page_size(0) == (60, 40) and doc.render(0).size == (60, 40)
        with pytest.raises(ImageTooLarge, match="64x64 pixels, over the limit of 3,000"):
            doc.render(1)


def test_frame_count_is_bounded(monkeypatch):
    """Counting frames reads every frame header: a small TIFF can chain millions of them."""
    import mineru_fast.inputs.documents as inputs

    frames = [Image.new("L", (8, 8), v) for v in (0, 100, 200)]
    data = image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    monkeypatch.setattr(inputs, "MAX_IMAGE_FRAMES", 3)
    with open_document(data) as doc:
        assert doc.page_count == 3 and doc.render(2).getpixel((0, 0)) == (200, 200, 200)
    monkeypatch.setattr(inputs, "MAX_IMAGE_FRAMES", 2)
    with pytest.raises(ImageTooLarge, match="more than 2 frames"):
        open_document(data)


def test_pillow_decompression_bomb_errors_become_image_too_large(monkeypatch):
    """Pillow's own guard raised ``DecompressionBombError``, which is no ``InputError``."""
    data = _two_frame_tiff((64, 64))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1500)  # frame 2 (4,096 px) is over 2x: Pillow refuses it
    with open_document(data) as doc:
        assert doc.render(0).size == (60, 40)  # 2,400 px: over 1x only, a warning, ignored
        with pytest.raises(ImageTooLarge, match="frame 2"):
            doc.render(1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageTooLarge):
        open_document(data)


def test_damaged_frame_is_a_typed_error():
    data = bytearray(_two_frame_tiff((64, 64)))
    data[-40:] = b"\xff" * 40  # the end of the file (the last frame's header) is garbage
    try:
        doc = open_document(bytes(data))
    except CorruptDocument:
        return
    with doc:
        for index in doc.page_indices:
            try:
                doc.render(index)
            except InputError:
                pass


def test_cmyk_converts_to_rgb():
    cmyk = Image.new("CMYK", (10, 10), (0, 255, 255, 0))  # pure red in CMYK
    with open_document(image_bytes(cmyk, "JPEG", quality=100)) as doc:
        r, g, b = doc.render(0).getpixel((5, 5))
    assert r > 230 and g < 30 and b < 30


def test_sixteen_bit_gray_scales_to_eight_bits():
    values = np.array([[0, 32768, 65535]], dtype=np.uint16)
    image = Image.frombytes("I;16", (values.shape[1], 1), values.astype("<u2").tobytes())
    rgb = to_rgb(image)
    assert [rgb.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


def test_alpha_and_palette_transparency_become_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgb = to_rgb(rgba)
    assert rgb.getpixel((1, 1)) == (255, 255, 255) and rgb.getpixel((0, 0)) == (10, 20, 30)
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 200, 0, 0])
    palette.info["transparency"] = 0
    assert to_rgb(palette).getpixel((0, 0)) == (255, 255, 255)


def test_sixteen_bit_trns_pixels_become_white():
    values = np.array([[255, 1000]], dtype=np.uint16)
    image = Image.frombytes("I;16", (values.shape[1], 1), values.astype("<u2").tobytes())
    image.info["transparency"] = 255
    assert to_rgb(image).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), "white")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    with open_document(image_bytes(image, "JPEG", exif=exif)) as doc:
        assert doc.render(0).size == (20, 40)


def test_pixel_limit_refuses_decompression_bombs():
    with pytest.raises(ImageTooLarge, match="limit"):
        open_document(image_bytes(Image.new("L", (400, 300)), "PNG"), max_pixels=100_000)


def test_huge_images_are_downscaled_to_max_side():
    with open_document(image_bytes(Image.new("RGB", (5000, 1000), "white"), "PNG"), max_side=3500) as doc:
        assert doc.render(0).size == (3500, 700)


def test_pil_image_source_is_one_page():
    with open_document(Image.new("LA", (30, 20))) as doc:
        assert doc.page_count == 1 and doc.render(0).mode == "RGB"


def test_truncated_image_is_corrupt():
    data = image_bytes(text_page(), "PNG")
    with pytest.raises(CorruptDocument):
        open_document(io.BytesIO(data[: len(data) // 2]).getvalue())


def test_callers_pil_image_stays_open():
    image = Image.new("RGB", (30, 20), "red")
    with open_document(image) as doc:
        doc.render(0)
    assert image.getpixel((0, 0)) == (255, 0, 0)  # still usable after close()


def test_a_range_past_the_document_is_clamped_with_a_warning(caplog):
    """``pages="1-3"`` (the README's example) was refused on a 2-page document; MinerU and docling
    clamp it to the document."""
    notes: list[str] = []
    with caplog.at_level("WARNING", logger="mineru_fast.inputs.documents"):
        assert parse_page_range("1-3", 2, notes=notes) == [0, 1]
    assert notes == ["page range '1-3' clamped to the document's 2 page(s): 1-2"]
    assert [r.getMessage() for r in caplog.records] == notes
    notes.clear()
    assert parse_page_range("2,5-9", 3, notes=notes) == [1]
    assert notes == ["page range '5-9' is past the document's 3 page(s): dropped"]
    assert parse_page_range("1-2", 2, notes=notes) == [0, 1] and len(notes) == 1  # nothing to clamp: no warning
    with pytest.raises(PageRangeError, match="'5-9' is outside 1-3"):  # nothing of the document left
        parse_page_range("5-9", 3)
    with open_document(pdf_bytes(2), pages="1-3") as opened:
        assert opened.page_indices == [0, 1] and opened.warnings == [
            "page range '1-3' clamped to the document's 2 page(s): 1-2"
        ]


def test_a_tiny_pdf_claiming_a_million_pages_is_refused_before_its_pages_are_listed():
    """A 335-byte PDF whose page tree claims 1M pages made ``parse`` write 723 MB of failure pages."""
    import tracemalloc

    from mineru_fast.errors import TooManyPages

    data = claimed_pages_pdf(1_000_000)
    assert len(data) < 400
    tracemalloc.start()
    try:
        with pytest.raises(TooManyPages, match="1,000,000 pages selected; one parse takes at most 10,000") as raised:
            open_document(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert raised.value.code == "too_many_pages" and isinstance(raised.value, InputError)
    assert peak < 2_000_000  # a list of a million page indices alone is ~40 MB
    with pytest.raises(TooManyPages, match="3 pages selected; one parse takes at most 2"):
        parse_page_range("1-3", 5, max_pages=2)
    with open_document(data, pages="1-3") as opened:  # a selection under the cap opens
        assert opened.page_count == 1_000_000 and opened.page_indices == [0, 1, 2]


def test_a_missing_file_is_a_file_not_found_input_error(tmp_path):
    from mineru_fast.errors import DocumentNotFound

    missing = tmp_path / "missing.pdf"
    with pytest.raises(DocumentNotFound) as raised:
        open_document(missing)
    assert isinstance(raised.value, InputError) and isinstance(raised.value, FileNotFoundError)
    assert str(raised.value) == f"no such file: {missing}" and raised.value.code == "document_not_found"


def test_only_the_supported_image_formats_are_opened(monkeypatch):
    """Pillow's EPS plugin ran Ghostscript on uploaded PostScript wherever ``gs`` is installed."""
    from PIL import EpsImagePlugin

    ran: list[object] = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs")  # as where Ghostscript is installed
    page = text_page(size=(120, 160), lines=2)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n%%EOF\n"
    refused = {"eps": eps, "ico": image_bytes(page.resize((64, 64)), "ICO"), "ppm": image_bytes(page, "PPM"),
               "tga": image_bytes(page, "TGA"), "pcx": image_bytes(page, "PCX")}  # fmt: skip
    for name, data in refused.items():
        with pytest.raises(UnsupportedFormat, match="not a PDF or a supported image format"):
            open_document(data)
        assert ran == [], name
    for fmt in ("PNG", "JPEG", "TIFF", "BMP", "GIF", "WEBP"):
        with open_document(image_bytes(page.convert("RGB"), fmt)) as opened:
            assert opened.format == fmt and opened.render(0).size == (120, 160)


def test_documents_mineru_4_reads_natively_are_refused_with_the_tool_that_reads_them(tmp_path):
    """DOCX, XLSX, EPUB, HTML, RTF, CSV: MinerU 4's flash tier (DocVortex) parses them without a
    model; mineru-fast runs the model on page images and says which tool to use instead."""
    import zipfile

    from mineru_fast.errors import NativeDocument
    from mineru_fast.inputs.documents import native_kind

    def archive(members: dict[str, bytes]) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as out:
            for name, data in members.items():
                out.writestr(name, data)
        return buffer.getvalue()

    docx = archive({"[Content_Types].xml": b"<Types/>", "word/document.xml": b"<w:document/>"})
    samples = {
        "report.docx": (docx, "DOCX"),
        "sheet.xlsx": (archive({"[Content_Types].xml": b"<Types/>", "xl/workbook.xml": b"<w/>"}), "XLSX"),
        "book.epub": (archive({"mimetype": b"application/epub+zip", "OEBPS/a.xhtml": b"<html/>"}), "EPUB"),
        "page.html": (b"<!DOCTYPE html><html><body><p>hi</p></body></html>", "HTML"),
        "letter.rtf": (b"{\\rtf1\\ansi hello}", "RTF"),
        "table.csv": (b"a,b\n1,2\n", "CSV"),
    }
    for name, (data, kind) in samples.items():
        assert native_kind(name, data) == kind
        (tmp_path / name).write_bytes(data)
        with pytest.raises(NativeDocument, match=f"a {kind} document.*--tier flash.*mineru-fast\\[mineru4\\]") as info:
            open_document(tmp_path / name)
        assert isinstance(info.value, UnsupportedFormat) and info.value.code == "native_document"
    assert native_kind("notes.bin", bytes(range(256))) is None


def test_a_pdf_of_no_pages_is_corrupt_whatever_the_document_before_it():
    """Audit round 4, N11: PDFium keeps one last error per process, and pypdfium2 refuses a PDF of
    no pages (which loads) with that error: after a wrong password, a 0-page PDF was answered
    ``password_required``; after a damaged PDF, "not a readable PDF (... Data format error)"."""
    from samples import encrypted_pdf, no_pages_pdf

    locked, damaged = encrypted_pdf("1234"), pdf_bytes(1)[:400]
    earlier = [
        (locked, "nope", PasswordRequired, "the password is wrong"),
        (locked, None, PasswordRequired, "it is encrypted"),
        (damaged, None, CorruptDocument, r"not a readable PDF \(.*Data format error"),
    ]
    for data, password, error, message in earlier:
        with pytest.raises(error, match=message):
            open_document(data, password=password)
        with pytest.raises(CorruptDocument) as info:
            open_document(no_pages_pdf())
        assert (info.value.code, str(info.value)) == ("corrupt_document", "document: the PDF has no pages")
    with open_document(locked, password="1234") as opened:
        assert opened.page_count == 1


def test_an_animation_is_read_as_its_first_frame_with_a_warning(caplog):
    """Audit round 4, N14: the frames of an animated GIF or WebP after the first were dropped
    without a word. Its first frame is the page, and the document's warnings (logged too) say the
    others are dropped; a still image has none."""
    frames = [Image.new("RGB", (60, 40), colour) for colour in ("red", "green", "blue")]
    for fmt, options in (("GIF", {}), ("WEBP", {"lossless": True}), ("PNG", {})):  # PNG: APNG
        data = image_bytes(frames[0], fmt, save_all=True, append_images=frames[1:], **options)
        caplog.clear()
        with caplog.at_level("WARNING", logger="mineru_fast.inputs.documents"), open_document(data) as doc:
            assert (doc.format, doc.page_count, doc.page_indices) == (fmt, 1, [0])
            assert doc.render(0).getpixel((5, 5)) == (255, 0, 0)
        assert doc.warnings == [
            f"document: an animated {fmt}: only its first frame is read; the other frames are dropped "
            "(save them as a multi-page TIFF or PDF to read each as a page)"
        ]
        assert [r.getMessage() for r in caplog.records] == doc.warnings
        with open_document(image_bytes(frames[1], fmt, **options)) as still:
            assert still.warnings == [] and still.render(0).getpixel((5, 5)) == (0, 128, 0)
