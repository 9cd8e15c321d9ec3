"""Tier 1: the protocol's pure logic (no model)."""

from __future__ import annotations

import pytest
from PIL import Image

from mineru_fast.protocol.spec import (
    LayoutBlock,
    SamplingParams,
    build_prompt,
    crop_block,
    detect_model_version,
    layout_image,
    prompt_for,
    sampling_for,
)


def test_prompts_and_sampling_tables_follow_mineru():
    assert prompt_for("layout") == "\nLayout Detection:"
    assert prompt_for("table") == "\nTable Recognition:"
    assert prompt_for("equation") == "\nFormula Recognition:"
    assert prompt_for("image") == "\nImage Analysis:"
    assert prompt_for("text") == "\nText Recognition:"
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


def test_sampling_table_equals_mineru_vl_utils():
    from mineru_vl_utils.mineru_client import DEFAULT_PROMPTS, DEFAULT_SAMPLING_PARAMS

    pairs = {"layout": "[layout]", "table": "table", "equation": "equation", "image": "image", "text": "[default]"}
    for ours, theirs in pairs.items():
        official = DEFAULT_SAMPLING_PARAMS[theirs]
        mine = sampling_for(ours)
        assert (mine.presence_penalty, mine.frequency_penalty) == (
            official.presence_penalty,
            official.frequency_penalty,
        )
        assert mine.no_repeat_ngram_size == official.no_repeat_ngram_size
        assert prompt_for(ours) == DEFAULT_PROMPTS[theirs]
    assert DEFAULT_SAMPLING_PARAMS["chart"] == DEFAULT_SAMPLING_PARAMS["image"]


def test_model_version_from_checkpoint_name_config_or_option(tmp_path):
    pro = tmp_path / "models--opendatalab--MinerU2.5-Pro-2605-1.2B" / "snapshots" / "abc"
    pro.mkdir(parents=True)
    old = tmp_path / "models--opendatalab--MinerU2.5-2509-1.2B" / "snapshots" / "a2509f"
    old.mkdir(parents=True)
    plain = tmp_path / "ckpt"
    plain.mkdir()
    assert detect_model_version(pro) == "pro-2605"
    assert detect_model_version(old) == "2509"
    assert detect_model_version(plain) == "pro-2605"  # names neither: MinerU 4's model
    (plain / "config.json").write_text('{"_name_or_path": "opendatalab/MinerU2.5-2509-1.2B"}')
    assert detect_model_version(plain) == "2509"
    # the config's name wins over the folder's, and "2509" inside a longer token names nothing
    (tmp_path / "x2509").mkdir()
    assert detect_model_version(tmp_path / "x2509") == "pro-2605"
    (old / "config.json").write_text('{"_name_or_path": "opendatalab/MinerU2.5-Pro-2605-1.2B"}')
    assert detect_model_version(old) == "pro-2605"
    assert detect_model_version(pro, "2509") == "2509"
    with pytest.raises(ValueError):
        detect_model_version(plain, "2511")
