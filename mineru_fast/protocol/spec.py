"""MinerU2.5's two-step protocol: chat format, tokens, prompts, sampling tables, model versions.

Pure Python (Pillow only, no torch). Facts follow opendatalab/mineru-vl-utils 2.0.x, the official
client of MinerU2.5: the chat format, the task prompts, the per-type sampling parameters and the
crop rules (rotate by the block angle, pad to an edge ratio of at most 50, upscale a short edge
below 28 pixels). The per-page steps (layout parsing, filters, crops, post-processing) are in
``protocol.page``, which calls mineru-vl-utils itself.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

logger = logging.getLogger(__name__)

# Qwen2 / Qwen2-VL special tokens, ids 151643..151656 in this order.
QWEN2VL_SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
OTSL_TOKENS: list[str] = ["<fcel>", "<ecel>", "<lcel>", "<ucel>", "<xcel>", "<nl>"]
ROTATE_TOKENS: dict[str, int] = {
    "<|rotate_up|>": 0,
    "<|rotate_right|>": 90,
    "<|rotate_down|>": 180,
    "<|rotate_left|>": 270,
}
# MinerU2.5's own added tokens. Their real ids are not public; nothing here depends on them.
MINERU_TOKENS: list[str] = ["<|ref_start|>", "<|ref_end|>", *ROTATE_TOKENS, *OTSL_TOKENS]

END_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
SYSTEM_PROMPT = "You are a helpful assistant."
# IEEE 754 binary32's largest finite value and smallest normal one (numpy.finfo(numpy.float32).max / .tiny):
# the decoding rules hold penalties in float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen2-VL ChatML; an image part becomes IMAGE_PLACEHOLDER (the processor expands the pad token).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Model versions (same architecture, same protocol; Pro was trained for image analysis).
MODEL_VERSIONS = ("2509", "pro-2605")
DEFAULT_MODEL_VERSION = "pro-2605"  # the one model of mineru 4.0.12's registry (mineru/model/registry.py)

LAYOUT_TASK = "layout"
LAYOUT_IMAGE_SIZE = (1036, 1036)  # 74x74 patches of 14 px -> 37x37 = 1369 image tokens
PROMPTS: dict[str, str] = {
    LAYOUT_TASK: "\nLayout Detection:",
    "table": "\nTable Recognition:",
    "equation": "\nFormula Recognition:",
    "image": "\nImage Analysis:",
}
DEFAULT_PROMPT = "\nText Recognition:"

MIN_CROP_EDGE = 28
MAX_CROP_EDGE_RATIO = 50


@dataclass(frozen=True)
class SamplingParams:
    """Decoding rules of one request. Decoding is always greedy (MinerU2.5 uses temperature 0).

    Attributes:
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted from a token's logit per time it was generated.
        repetition_penalty: multiplicative penalty (CTRL / vLLM semantics) on every token of the
            prompt or the output so far: a positive logit is divided by it, a negative one
            multiplied. 1.0 (MinerU's value) disables it.
        no_repeat_ngram_size: a token that would repeat an n-gram of the generated tokens is banned
            (the prompt does not count). 0 disables.
        max_new_tokens: hard bound on generated tokens, the end token included.
        min_new_tokens: the end tokens are banned until this many tokens are generated (vLLM's
            ``min_tokens``); 0 (MinerU's value) disables it.

    Raises:
        ValueError: a bound out of range, a penalty that is not finite or not within float32's
            range (``FLOAT32_MAX``), a repetition penalty below ``FLOAT32_TINY``.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 100
    max_new_tokens: int = 4096
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise ValueError(f"{name} must be a finite number within float32's range, got {value}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in 0..max_new_tokens, got {self.min_new_tokens}")
        if self.repetition_penalty < FLOAT32_TINY:
            raise ValueError(f"repetition_penalty must be >= float32's smallest normal, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")


# mineru-vl-utils 2.0.x DEFAULT_SAMPLING_PARAMS ("image" covers image and chart analysis); the
# max_new_tokens bounds are ours (the official client relies on the server's context limit).
SAMPLING: dict[str, SamplingParams] = {
    LAYOUT_TASK: SamplingParams(max_new_tokens=4096),
    "table": SamplingParams(presence_penalty=1.0, frequency_penalty=0.005, max_new_tokens=8192),
    "equation": SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=4096),
    "image": SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=4096),
}
DEFAULT_SAMPLING = SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=4096)


def prompt_for(task: str) -> str:
    """Task prompt of a task (``"layout"``, ``"table"``, ``"equation"``, ``"image"``, ``"text"``)."""
    return PROMPTS.get(task, DEFAULT_PROMPT)


def sampling_for(task: str) -> SamplingParams:
    """Default sampling parameters of a layout task or block type."""
    return SAMPLING.get(task, DEFAULT_SAMPLING)


def build_prompt(task_prompt: str) -> str:
    """The full chat text of one request, with one image placeholder.

    Equal to ``CHAT_TEMPLATE`` rendered with one user turn ``[image, text]`` and a generation prompt.
    """
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{task_prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def detect_model_version(model_dir: str | Path, requested: str = "auto") -> str:
    """The MinerU2.5 version of a checkpoint: ``"2509"`` or ``"pro-2605"``.

    ``requested`` other than ``"auto"`` wins. Otherwise the checkpoint's ``config.json``
    ``_name_or_path`` and its directory path (hub cache folders are named after the repo, e.g.
    ``models--opendatalab--MinerU2.5-2509-1.2B``) are searched: "pro" followed by "2605" names
    Pro-2605, a standalone "2509" names 2509, and a checkpoint that names neither is taken as
    ``DEFAULT_MODEL_VERSION`` (Pro-2605, MinerU 4's model; synthetic models name their version in
    ``_name_or_path``, and those written before they did are Pro-2605 too).

    Raises:
        ValueError: ``requested`` is not "auto" or one of ``MODEL_VERSIONS``.
    """
    if requested != "auto":
        if requested not in MODEL_VERSIONS:
            raise ValueError(f"model_version must be 'auto' or one of {MODEL_VERSIONS}, got {requested!r}")
        return requested
    names = [str(Path(model_dir).resolve())]
    try:
        names.insert(0, str(json.loads((Path(model_dir) / "config.json").read_text()).get("_name_or_path", "")))
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        if re.search(r"pro.?2605", name, re.IGNORECASE):
            return "pro-2605"
        if re.search(r"(?<![A-Za-z0-9])2509(?![A-Za-z0-9])", name):
            return "2509"
    return DEFAULT_MODEL_VERSION


@dataclass(frozen=True)
class LayoutBlock:
    """A block box for ``crop_block`` (engine tests and benchmarks cut crops without a layout).

    Attributes:
        type: a block type.
        bbox: ``(x1, y1, x2, y2)`` normalized to 0..1 of the page, x1 < x2, y1 < y2.
        angle: text rotation in degrees counter-clockwise (0, 90, 180, 270) or None.
    """

    type: str
    bbox: tuple[float, float, float, float]
    angle: int | None = None


def layout_image(page: Image.Image) -> Image.Image:
    """The layout step's input: the RGB page resized to exactly 1036x1036 (bicubic)."""
    return page.convert("RGB").resize(LAYOUT_IMAGE_SIZE, Image.Resampling.BICUBIC)


def crop_block(page: Image.Image, block: LayoutBlock) -> Image.Image | None:
    """Cut a block out of the full-resolution page for the content step.

    The box is scaled to page pixels, cropped, rotated by the block angle (counter-clockwise, canvas
    expanded), padded with white to an edge ratio of at most 50, and upscaled (bicubic) so the short
    edge is at least 28 pixels.

    Returns:
        The RGB crop, or None when the box covers less than one pixel.
    """
    width, height = page.size
    x1, y1, x2, y2 = block.bbox
    crop = page.crop((x1 * width, y1 * height, x2 * width, y2 * height))
    if crop.width < 1 or crop.height < 1:
        return None
    if block.angle in (90, 180, 270):
        crop = crop.rotate(block.angle, expand=True)
    if max(crop.size) / min(crop.size) > MAX_CROP_EDGE_RATIO:
        w, h = crop.size
        new_w, new_h = (w, math.ceil(w / MAX_CROP_EDGE_RATIO)) if w > h else (math.ceil(h / MAX_CROP_EDGE_RATIO), h)
        canvas = Image.new("RGB", (new_w, new_h), (255, 255, 255))
        canvas.paste(crop, ((new_w - w) // 2, (new_h - h) // 2))
        crop = canvas
    if min(crop.size) < MIN_CROP_EDGE:
        scale = MIN_CROP_EDGE / min(crop.size)
        crop = crop.resize((math.ceil(crop.width * scale), math.ceil(crop.height * scale)), Image.Resampling.BICUBIC)
    return crop
