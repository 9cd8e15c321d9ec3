"""Synthetic documents made here, so tests do not depend on third-party files."""

from __future__ import annotations

import io

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
