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
    from mineru_fast.traces import PageTrace, Trace

    return Trace([PageTrace(SAMPLE_LAYOUT, list(SAMPLE_CONTENTS)) for _ in range(n_pages)])


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
