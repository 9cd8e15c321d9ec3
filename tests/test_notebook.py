"""Tier 1: how documents and pages show in a notebook (IPython's ``_repr_*_`` protocol)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from samples import text_page

from mineru_fast.results.document import Document
from mineru_fast.results.page import NOTEBOOK_MAX_SIDE, Block, Page, layout_overlay


def test_page_shows_its_layout_overlay_scaled_for_the_notebook():
    page = Page(0, (1700, 2200), [Block("title", (0.1, 0.05, 0.5, 0.1)), Block("text", (0.1, 0.12, 0.6, 0.5))])
    page.image = text_page((1700, 2200))
    shown = Image.open(io.BytesIO(page._repr_png_()))
    assert shown.format == "PNG" and shown.size == (round(1700 * NOTEBOOK_MAX_SIDE / 2200), NOTEBOOK_MAX_SIDE)
    expected = layout_overlay(page)
    expected.thumbnail((NOTEBOOK_MAX_SIDE, NOTEBOOK_MAX_SIDE))
    assert np.array_equal(np.asarray(shown), np.asarray(expected))
    red, green, blue = shown.getpixel((round(0.3 * shown.width), round(0.08 * shown.height)))  # inside the title box
    assert red > green and red > blue  # tinted with the title color, not the page's white or black

    small = Page(1, (300, 200), [], image=text_page((300, 200)))
    assert Image.open(io.BytesIO(small._repr_png_())).size == (300, 200)  # never enlarged
    assert Page(2)._repr_png_() is None  # no image (render failed): IPython falls back to the text repr
    document = Document("d", pages=[page])
    page.blocks[0].content = "Title"
    assert document._repr_markdown_() == document.to_markdown() and "# Title" in document._repr_markdown_()
