"""Tier 1: the protocol's pure logic (no model)."""

from __future__ import annotations

import pytest
from PIL import Image

from mineru_fast.protocol import (
    LayoutBlock,
    SamplingParams,
    build_prompt,
    crop_block,
    layout_image,
    parse_layout,
    prompt_for,
    sampling_for,
    task_of,
)


def line(box: str, kind: str, rotate: str = "<|rotate_up|>") -> str:
    return f"<|box_start|>{box}<|box_end|><|ref_start|>{kind}<|ref_end|>{rotate}"


def test_parse_layout_reads_boxes_types_angles_in_order():
    text = "\n".join(
        [
            line("010 020 500 080", "title"),
            line("010 100 990 400", "text", "<|rotate_right|>"),
            line("100 500 900 950", "table", "<|rotate_left|>"),
            line("100 960 200 990", "page_number", ""),
        ]
    )
    blocks, warnings = parse_layout(text)
    assert warnings == []
    assert blocks == [
        LayoutBlock("title", (0.01, 0.02, 0.5, 0.08), 0),
        LayoutBlock("text", (0.01, 0.1, 0.99, 0.4), 90),
        LayoutBlock("table", (0.1, 0.5, 0.9, 0.95), 270),
        LayoutBlock("page_number", (0.1, 0.96, 0.2, 0.99), None),
    ]


def test_parse_layout_swaps_inverted_and_drops_invalid():
    text = "".join(
        [
            line("500 600 100 200", "text"),  # inverted -> swapped
            line("100 100 100 300", "text"),  # empty width -> dropped
            line("100 100 1001 300", "text"),  # out of range -> dropped
            line("100 100 300 300", "sticker"),  # unknown type -> dropped
            line("100 100 300 300", "Image_Caption"),  # case-insensitive type
        ]
    )
    blocks, warnings = parse_layout(text)
    assert blocks == [
        LayoutBlock("text", (0.1, 0.2, 0.5, 0.6), 0),
        LayoutBlock("image_caption", (0.1, 0.1, 0.3, 0.3), 0),
    ]
    assert len(warnings) == 3


def test_parse_layout_garbage_gives_zero_blocks_and_a_warning():
    garbage = "<|txtMask fill:#>\n" * 500
    blocks, warnings = parse_layout(garbage)
    assert blocks == []
    assert len(warnings) == 1 and "no valid block" in warnings[0]
    assert parse_layout("") == ([], [])


def test_prompts_and_sampling_tables_follow_mineru():
    assert prompt_for("layout") == "\nLayout Detection:"
    assert prompt_for(task_of("table")) == "\nTable Recognition:"
    assert prompt_for(task_of("equation")) == "\nFormula Recognition:"
    assert prompt_for(task_of("title")) == "\nText Recognition:"
    assert sampling_for("layout") == SamplingParams(0.0, 0.0, 100, 4096)
    assert (sampling_for("table").presence_penalty, sampling_for("table").frequency_penalty) == (1.0, 0.005)
    assert (sampling_for("equation").presence_penalty, sampling_for("equation").frequency_penalty) == (1.0, 0.05)
    assert (sampling_for("text").presence_penalty, sampling_for("text").frequency_penalty) == (1.0, 0.05)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)


def test_build_prompt_is_qwen2vl_chatml():
    assert build_prompt("\nLayout Detection:") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nLayout Detection:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_layout_image_is_1036_square_rgb():
    image = layout_image(Image.new("L", (300, 700), 128))
    assert image.size == (1036, 1036) and image.mode == "RGB"


def page_with_marker() -> Image.Image:
    """1000x800 white page with a red 100x50 rectangle at (200, 300)."""
    page = Image.new("RGB", (1000, 800), "white")
    page.paste((255, 0, 0), (200, 300, 300, 350))
    return page


def test_crop_uses_full_resolution_box():
    crop = crop_block(page_with_marker(), LayoutBlock("text", (0.2, 0.375, 0.3, 0.4375)))
    assert crop.size == (100, 50)
    assert crop.getpixel((50, 25)) == (255, 0, 0)


def test_crop_rotates_counter_clockwise_with_expand():
    page = page_with_marker()
    page.paste((0, 0, 255), (200, 300, 210, 350))  # blue strip on the left edge of the marker
    crop = crop_block(page, LayoutBlock("text", (0.2, 0.375, 0.3, 0.4375), 90))
    assert crop.size == (50, 100)
    # rotated 90 degrees counter-clockwise, the left edge becomes the bottom edge
    assert crop.getpixel((25, 95)) == (0, 0, 255)
    assert crop.getpixel((25, 5)) == (255, 0, 0)


def test_crop_pads_extreme_ratio_to_50_and_upscales_short_edge():
    page = Image.new("RGB", (5000, 1000), "black")
    crop = crop_block(page, LayoutBlock("text", (0.0, 0.0, 1.0, 0.01)))  # 5000x10
    # ratio 500 -> padded with white to 5000x100, short edge 100 >= 28: no upscaling
    assert crop.size == (5000, 100)
    assert crop.getpixel((0, 0)) == (255, 255, 255) and crop.getpixel((0, 50)) == (0, 0, 0)
    small = crop_block(page, LayoutBlock("text", (0.0, 0.0, 0.002, 0.01)))  # 10x10
    assert small.size == (28, 28)


def test_crop_below_one_pixel_is_none():
    assert crop_block(Image.new("RGB", (100, 100)), LayoutBlock("text", (0.5, 0.5, 0.501, 0.6))) is None
