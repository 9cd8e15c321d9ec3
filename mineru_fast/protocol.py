"""MinerU2.5's two-step protocol: prompts, sampling tables, layout parsing, crop geometry.

Pure Python (Pillow only, no torch). Facts follow opendatalab/mineru-vl-utils 0.1.x, the official
client of MinerU2.5: the chat format, the task prompts, the per-type sampling parameters, the
layout line format and the crop rules (rotate by the block angle, pad to an edge ratio of at most
50, upscale a short edge below 28 pixels).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

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

BLOCK_TYPES: frozenset[str] = frozenset(
    {
        "text", "title", "table", "image", "code", "algorithm", "header", "footer", "page_number",
        "page_footnote", "aside_text", "equation", "equation_block", "ref_text", "list", "phonetic",
        "table_caption", "image_caption", "code_caption", "table_footnote", "image_footnote",
        "unknown",
    }
)  # fmt: skip
PARATEXT_TYPES: frozenset[str] = frozenset({"header", "footer", "page_number", "aside_text", "page_footnote"})
NOT_READ_TYPES: frozenset[str] = frozenset({"image", "list", "equation_block"})

LAYOUT_TASK = "layout"
LAYOUT_IMAGE_SIZE = (1036, 1036)  # 74x74 patches of 14 px -> 37x37 = 1369 image tokens
PROMPTS: dict[str, str] = {
    LAYOUT_TASK: "\nLayout Detection:",
    "table": "\nTable Recognition:",
    "equation": "\nFormula Recognition:",
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
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 100
    max_new_tokens: int = 4096
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in 0..max_new_tokens, got {self.min_new_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")


# mineru-vl-utils DEFAULT_SAMPLING_PARAMS; the max_new_tokens bounds are ours (the official client
# relies on the server's context limit).
SAMPLING: dict[str, SamplingParams] = {
    LAYOUT_TASK: SamplingParams(max_new_tokens=4096),
    "table": SamplingParams(presence_penalty=1.0, frequency_penalty=0.005, max_new_tokens=8192),
    "equation": SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=4096),
}
DEFAULT_SAMPLING = SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=4096)


def task_of(block_type: str) -> str:
    """The prompt/sampling key of a block type: ``table``, ``equation`` or ``text``."""
    return block_type if block_type in ("table", "equation") else "text"


def prompt_for(task: str) -> str:
    """Task prompt of a layout task or block type (``"layout"``, ``"table"``, ``"text"``, ...)."""
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


@dataclass(frozen=True)
class LayoutBlock:
    """One block of the layout step.

    Attributes:
        type: a MinerU2.5 block type (see ``BLOCK_TYPES``).
        bbox: ``(x1, y1, x2, y2)`` normalized to 0..1 of the page, x1 < x2, y1 < y2.
        angle: text rotation in degrees counter-clockwise (0, 90, 180, 270), None when the model
            gave no rotate token.
    """

    type: str
    bbox: tuple[float, float, float, float]
    angle: int | None = None


_LAYOUT_RE = re.compile(
    r"<\|box_start\|>\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*<\|box_end\|>"
    r"<\|ref_start\|>\s*(\w+?)\s*<\|ref_end\|>(.*?)(?=<\|box_start\|>|$)",
    re.DOTALL,
)


def _bbox(coords: tuple[str, str, str, str]) -> tuple[float, float, float, float] | None:
    x1, y1, x2, y2 = (int(c) for c in coords)
    if any(c < 0 or c > 1000 for c in (x1, y1, x2, y2)):
        return None
    x1, x2 = min(x1, x2), max(x1, x2)
    y1, y2 = min(y1, y2), max(y1, y2)
    if x1 == x2 or y1 == y2:
        return None
    return (x1 / 1000, y1 / 1000, x2 / 1000, y2 / 1000)


def parse_layout(text: str) -> tuple[list[LayoutBlock], list[str]]:
    """Parse the layout step's output into blocks, in the model's (reading) order.

    Lines look like ``<|box_start|>x1 y1 x2 y2<|box_end|><|ref_start|>type<|ref_end|><|rotate_up|>``
    with integer coordinates 0..1000. Out-of-range or empty boxes and unknown types are dropped;
    inverted corners are swapped. Never raises: garbage yields no blocks and a warning.

    Returns:
        ``(blocks, warnings)``; warnings are human-readable strings (also logged).
    """
    blocks: list[LayoutBlock] = []
    warnings: list[str] = []
    for match in _LAYOUT_RE.finditer(text):
        *coords, block_type, tail = match.groups()
        bbox = _bbox(tuple(coords))
        block_type = block_type.lower()
        if bbox is None:
            warnings.append(f"dropped layout block with invalid box {' '.join(coords)}")
        elif block_type not in BLOCK_TYPES:
            warnings.append(f"dropped layout block of unknown type {block_type!r}")
        else:
            angle = next((a for tok, a in ROTATE_TOKENS.items() if tok in tail), None)
            blocks.append(LayoutBlock(block_type, bbox, angle))
    if not blocks and text.strip():
        warnings.append(f"layout output has no valid block ({len(text)} characters)")
    for w in warnings:
        logger.warning(w)
    return blocks, warnings


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
