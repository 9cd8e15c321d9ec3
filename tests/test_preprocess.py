"""The engine's own preprocessing gives the ids and pixels transformers gives for the same checkpoint.

``engine.preprocess`` reads ``tokenizer.json`` with the ``tokenizers`` library and
``engine.image_processor`` reproduces ``Qwen2VLImageProcessorPil``, so start-up skips
transformers' modules. transformers stays the oracle here: the same inputs through
``AutoTokenizer`` / ``AutoImageProcessor`` must give exactly the same ids, text and float32 pixels.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
from PIL import Image

from mineru_fast.engine.image_processor import ImageProcessor, smart_resize
from mineru_fast.engine.preprocess import Preprocessor
from mineru_fast.errors import ModelLoadError

TEXTS = [
    "Plain English text, with punctuation; and numbers 12345.",
    "é 中文表格 😀 ＡＢ１ full-width ＆ forms",
    "<|box_start|>100 200 300 400<|box_end|><|ref_start|>text<|ref_end|>",
    "<fcel>a<fcel>b<nl><ecel><lcel><nl>",
    "typed control tokens <|im_start|>user\n<|image_pad|><|im_end|> stay text",
    "\\[ x^2 + \\frac{a}{b} \\]\n\n  indented\tand tabbed  ",
    "",
]


@pytest.fixture(scope="module")
def both(tiny_model):
    from transformers import AutoImageProcessor, AutoTokenizer

    return (
        Preprocessor(tiny_model),
        AutoTokenizer.from_pretrained(str(tiny_model)),
        AutoImageProcessor.from_pretrained(str(tiny_model)),
    )


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_equal_transformers(both, text):
    """Model-output encoding (special tokens matched), plain-text encoding (special tokens as
    characters) and decoding with and without special tokens."""
    pre, tokenizer, _ = both
    assert pre.text_ids(text) == tokenizer.encode(text, add_special_tokens=False)
    plain = tokenizer([text], add_special_tokens=False, split_special_tokens=True)["input_ids"][0]
    assert pre.plain_text_ids([text]) == [plain]
    ids = pre.text_ids(text)
    kept = [t for t in ids if t not in pre.end_ids]  # decode drops end tokens by design
    for skip in (False, True):
        assert pre.decode(ids, skip_special_tokens=skip) == tokenizer.decode(kept, skip_special_tokens=skip)


def test_plain_ids_do_not_leak_into_output_encoding(both):
    """The plain-text switch is flipped back: the next model-output encoding matches specials."""
    pre, tokenizer, _ = both
    pre.plain_text_ids(["<|im_end|>"])
    assert pre.text_ids("<|im_end|>") == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize(
    "text",
    [
        "e\u0301te\u0301 and \u00e9t\u00e9",  # decomposed and composed accents side by side
        "A\u030a \u212b \u00c5",  # a ring above, the angstrom sign, the composed letter
        "\u05e9\u05dc\u05d5\u05dd abc \u0627\u0644\u0633\u0644\u0627\u0645 \u202eevil\u202c",  # bidirectional
        "\u1100\u1161\u11a8 x\u0308<|box_start|>012 034<|box_end|>",  # conjoining jamo, specials kept
    ],
)
def test_forced_outputs_decode_to_their_code_points(both, text):
    """Replay forces a trace's text as a model would have produced it: decoding the forced ids
    gives every code point back (the tokenizer's NFC normalizer, which prompts keep, would compose
    them: the lane's official side keeps raw outputs as they come)."""
    pre, tokenizer, _ = both
    ids = pre.forced_ids(text)
    assert ids[-1] == pre.end_ids[0] and pre.decode(ids) == text
    if unicodedata.normalize("NFC", text) != text:  # the normalized encoding would not round-trip
        normalized = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(normalized) == unicodedata.normalize("NFC", text)


SIZES = [(1036, 1036), (1700, 2200), (37, 612), (5, 900), (2100, 90), (64, 64), (3, 3), (4000, 3000), (28, 5500)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pixels_equal_transformers_bitwise(both, size):
    """Below min_pixels, above max_pixels, odd edges and near the edge-ratio bound: the same grid
    and bitwise the same float32 patches."""
    pre, _, processor = both
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    ours, grid = pre.image_processor(image)
    theirs = processor(images=[image], return_tensors="pt")
    assert grid == tuple(int(v) for v in theirs["image_grid_thw"][0])
    assert ours.dtype == theirs["pixel_values"].dtype and ours.shape == theirs["pixel_values"].shape
    assert np.array_equal(ours.numpy(), theirs["pixel_values"].numpy())


def test_grayscale_equals_transformers_and_a_thin_strip_is_refused(both):
    pre, _, processor = both
    gray = Image.fromarray(np.arange(300 * 200, dtype=np.uint32).reshape(300, 200).astype(np.uint8), "L")
    ours, _ = pre.image_processor(gray)
    assert np.array_equal(ours.numpy(), processor(images=[gray], return_tensors="pt")["pixel_values"].numpy())
    with pytest.raises(ValueError, match="edge ratio"):
        pre.image_processor(Image.new("RGB", (201 * 30, 30)))


def test_smart_resize_bounds():
    """Multiples of 28, area within the bounds, MinerU2.5's numbers (3136 .. 2048*28*28)."""
    for h, w in [(10, 10), (1036, 1036), (5000, 4000), (100, 19000)]:
        th, tw = smart_resize(h, w, 28, 3136, 1605632)
        assert th % 28 == 0 and tw % 28 == 0 and 3136 <= th * tw <= 1605632
    assert smart_resize(1036, 1036, 28, 3136, 1605632) == (1036, 1036)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"image_processor_type": "CLIPImageProcessor"}, "not Qwen2-VL's"),
        ({"do_normalize": False}, "do_normalize turned off"),
        ({"size": {}}, "no pixel bounds"),
        ({"image_mean": None}, "bad image processor settings"),
        ({"image_std": [0.5]}, "one value per RGB channel"),
        ({"size": 3136}, "not a mapping"),
    ],
)
def test_other_image_processors_are_refused(tiny_model, tmp_path, change, message):
    config = json.loads((tiny_model / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=message):
        ImageProcessor.from_pretrained(tmp_path)


def test_top_level_pixel_bounds_override_size(tiny_model, tmp_path):
    """As transformers reads them: min_pixels / max_pixels beside ``size`` win."""
    config = json.loads((tiny_model / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "max_pixels": 200704}))
    assert ImageProcessor.from_pretrained(tmp_path).max_pixels == 200704


def test_a_missing_or_broken_tokenizer_is_a_model_load_error(tiny_model, tmp_path):
    (tmp_path / "preprocessor_config.json").write_text((tiny_model / "preprocessor_config.json").read_text())
    with pytest.raises(ModelLoadError, match="no tokenizer.json; write it once"):
        Preprocessor(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        Preprocessor(tmp_path)
