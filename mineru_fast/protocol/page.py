"""One page of MinerU2.5's two-step protocol as pure functions (Pillow only, no torch).

The parser (or any scheduler) drives a page through three calls:

1. ``read_layout(text)``: the layout step's raw output -> ``PageLayout`` (blocks in reading order,
   warnings). Grammar, duplicate-box suppression and the table-internal filter are mineru-vl-utils'
   own (``MinerUClientHelper.parse_layout_output``); a block type that library does not know is kept
   as a ``text`` block carrying its raw type, with a warning, instead of being dropped.
2. ``plan_content(page_image, layout, image_analysis=...)``: which blocks are read and how: one
   ``ContentRequest`` (block index, crop, task, prompt) per block, from mineru-vl-utils'
   ``prepare_for_extract`` (image captions inside images dropped, crops rotated / padded / upscaled,
   images inside tables masked).
3. ``results.finish.finish_blocks(layout, outputs)``: the raw content outputs (``ContentOutput``)
   -> the page's final blocks, through the same helper's ``post_process``.

Everything here is deterministic and safe to call from worker threads (no shared state but the
immutable helper).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image

from mineru_fast.protocol.spec import LAYOUT_IMAGE_SIZE, MAX_CROP_EDGE_RATIO, MIN_CROP_EDGE

logger = logging.getLogger(__name__)

__all__ = [
    "PageLayout",
    "ContentRequest",
    "ContentOutput",
    "read_layout",
    "layout_from_blocks",
    "plan_content",
    "vl_helper",
    "RAW_TYPE_KEY",
    "INDEX_KEY",
    "official_block_types",
]

# Key under which a block's raw (unknown) layout type travels inside a mineru-vl-utils ContentBlock.
RAW_TYPE_KEY = "mineru_fast_raw_type"
INDEX_KEY = "mineru_fast_index"  # a block's index in its layout, carried through post_process
# Types the library treats specially before its type check: "unknown" is read as an image and
# "inline_formula" lines are skipped (their content is part of the surrounding text).
_SPECIAL_TYPES = frozenset({"unknown", "inline_formula"})
_ANGLES = {"<|rotate_up|>": 0, "<|rotate_right|>": 90, "<|rotate_down|>": 180, "<|rotate_left|>": 270}
_LINE_RE = re.compile(
    r"<\|box_start\|>(\d+)\s+(\d+)\s+(\d+)\s+(\d+)<\|box_end\|><\|ref_start\|>(\w+?)<\|ref_end\|>"
    r"(<\|rotate_(?:up|right|down|left)\|>)?",
    re.DOTALL,
)
# Content step task of each prompt key (the ``ContentRequest.task``).
_TASKS = {"table": "table", "equation": "equation", "image": "image", "chart": "image"}


def official_block_types() -> frozenset[str]:
    """The 31 block types of mineru-vl-utils 2.x (``structs.BLOCK_TYPES``)."""
    from mineru_vl_utils.structs import BLOCK_TYPES

    return frozenset(BLOCK_TYPES)


def vl_helper():
    """A ``MinerUClientHelper`` configured as mineru 4.0.12 configures its client."""
    global _HELPER
    if _HELPER is None:
        from loguru import logger as loguru_logger
        from mineru_vl_utils.mineru_client import DEFAULT_PROMPTS, DEFAULT_SAMPLING_PARAMS, MinerUClientHelper

        # The library logs every layout line without a rotate token and the like through loguru to
        # stderr; the problems that matter are page warnings here (and logged with ``logging``).
        loguru_logger.disable("mineru_vl_utils")

        _HELPER = MinerUClientHelper(
            backend="transformers",  # any local backend: crops stay PIL images (not PNG bytes)
            prompts=DEFAULT_PROMPTS,
            sampling_params=DEFAULT_SAMPLING_PARAMS,
            layout_image_size=LAYOUT_IMAGE_SIZE,
            min_image_edge=MIN_CROP_EDGE,
            max_image_edge_ratio=MAX_CROP_EDGE_RATIO,
            simple_post_process=False,
            handle_equation_block=True,
            abandon_list=False,
            abandon_paratext=False,
            image_analysis=False,  # decided per call (model version / option)
            debug=False,
            enable_table_formula_eq_wrap=True,  # mineru 4.0.12 (model/vlm/runtime.py)
            enable_cross_page_table_merge=False,
        )
    return _HELPER


_HELPER = None


@dataclass
class PageLayout:
    """A page's layout as read from the layout step.

    Attributes:
        blocks: mineru-vl-utils ``ContentBlock`` dicts in reading order (``type``, ``bbox`` as 0..1
            floats, ``angle``, ``content``, ``merge_prev`` for text). A block of a type the library
            does not know has type ``text`` and its raw type under ``RAW_TYPE_KEY``. The list is
            modified in place by ``plan_content`` (image captions inside an image are dropped there,
            as the official client does) and read by ``finish_blocks``.
        warnings: human-readable problems (unknown types, invalid lines); also logged.
        raw: the layout text as given.
    """

    blocks: list = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    raw: str = ""

    @property
    def unknown_types(self) -> list[str]:
        """Raw types of the blocks kept as text because the protocol does not know them."""
        return [b[RAW_TYPE_KEY] for b in self.blocks if RAW_TYPE_KEY in b]


def _valid_box(x1: int, y1: int, x2: int, y2: int) -> bool:
    """mineru-vl-utils keeps a box with every coordinate in 0..1000 and a non-zero area."""
    return all(0 <= v <= 1000 for v in (x1, y1, x2, y2)) and x1 != x2 and y1 != y2


def read_layout(text: str) -> PageLayout:
    """Parse a layout-step output into blocks, as mineru-vl-utils 2.0.x does, losing no block.

    Lines look like ``<|box_start|>x1 y1 x2 y2<|box_end|><|ref_start|>type<|ref_end|><|rotate_up|>``
    (coordinates 0..1000, optional rotate token, ``txt_contd_tgt`` in the tail of a text line sets
    ``merge_prev``). The library drops boxes out of range or empty (swapping inverted corners),
    reads ``unknown`` as ``image``, skips ``inline_formula``, suppresses a box of the same type and
    angle overlapping an earlier one with IoU > 0.9, and drops text / equation boxes at least 90 %
    inside a table. A type it does not know is kept here as ``text`` with a warning; lines that do
    not follow the grammar or have an invalid box (which the library drops silently) are counted
    in a warning.

    Never raises: garbage yields no blocks and a warning.
    """
    known = official_block_types()
    tagged: dict[tuple, str] = {}  # (box, angle) -> raw type of the lines kept as text

    def keep_unknown(match: re.Match[str]) -> str:
        raw_type = match.group(5).lower()
        if raw_type in known or raw_type in _SPECIAL_TYPES:
            return match.group(0)
        x1, y1, x2, y2 = (int(v) for v in match.group(1, 2, 3, 4))
        box = (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))
        tagged.setdefault((box, _ANGLES[match.group(6)] if match.group(6) else None), raw_type)
        start, end = match.span(5)
        return match.group(0)[: start - match.start()] + "text" + match.group(0)[end - match.start() :]

    layout = PageLayout(raw=text)
    layout.blocks = vl_helper().parse_layout_output(_LINE_RE.sub(keep_unknown, text))
    for block in layout.blocks:
        key = (tuple(round(v * 1000) for v in block["bbox"]), block.get("angle"))
        if block["type"] == "text" and key in tagged:
            block[RAW_TYPE_KEY] = tagged[key]
    matches = list(_LINE_RE.finditer(text))
    invalid = sum(not _valid_box(*(int(v) for v in m.group(1, 2, 3, 4))) for m in matches)
    dropped = text.count("<|box_start|>") - len(matches) + invalid
    if dropped:
        layout.warnings.append(f"dropped {dropped} malformed or out-of-range layout line(s)")
    unknown = list(tagged.values())
    for raw_type in dict.fromkeys(unknown):
        layout.warnings.append(f"layout block type {raw_type!r} is unknown to the protocol; kept as text")
    if not layout.blocks and text.strip():
        layout.warnings.append(f"layout output has no valid block ({len(text)} characters)")
    for warning in layout.warnings:
        logger.warning(warning)
    return layout


def layout_from_blocks(blocks: Sequence[tuple[str, Sequence[float], int | None, str | None]]) -> PageLayout:
    """A ``PageLayout`` from blocks found by another layout model (the standard tier's detector),
    as mineru-vl-utils' ``batch_extract_with_layout`` takes them: no content, reading order kept.

    Args:
        blocks: ``(type, bbox 0..1, angle, sub_type)`` per block, types of mineru-vl-utils'
            ``BLOCK_TYPES``.

    Raises:
        ValueError: a type the protocol does not know, or a box outside 0..1 or empty.
    """
    from mineru_vl_utils.structs import ContentBlock

    known = official_block_types()
    layout = PageLayout()
    for block_type, bbox, angle, sub_type in blocks:
        if block_type not in known:
            raise ValueError(f"block type {block_type!r} is not one of mineru-vl-utils' types")
        x1, y1, x2, y2 = (float(v) for v in bbox)
        if not (0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1):
            raise ValueError(f"block box {tuple(bbox)} is not a non-empty box inside 0..1")
        block = ContentBlock(block_type, [x1, y1, x2, y2], angle=angle)
        if sub_type is not None:
            block["sub_type"] = sub_type
        layout.blocks.append(block)
    return layout


@dataclass(frozen=True)
class ContentRequest:
    """One content-step request of a page.

    Attributes:
        block_index: index into ``PageLayout.blocks`` (after ``plan_content``'s filtering).
        image: the RGB crop to send (rotated, padded to an edge ratio <= 50, short edge >= 28).
        task: ``"text"``, ``"table"``, ``"equation"`` or ``"image"`` (image analysis of an image or
            chart): the key of the sampling table and of the ``max_new_tokens`` bounds.
        prompt: the task prompt (``"\\nText Recognition:"``, ``"\\nImage Analysis:"``, ...).
    """

    block_index: int
    image: Image.Image
    task: str
    prompt: str


def plan_content(page_image: Image.Image, layout: PageLayout, *, image_analysis: bool) -> list[ContentRequest]:
    """The content requests of a page, in block order, as mineru-vl-utils' ``prepare_for_extract``.

    Not read: ``list``, ``equation_block``, ``image_block`` (containers), images absorbed into a
    table, and ``image`` / ``chart`` unless ``image_analysis`` (then only standalone ones larger than
    10 % of the page on both sides or 1 % of its area). Image captions at least 90 % inside an image,
    chart or image block are removed from ``layout.blocks`` here.

    Args:
        page_image: the full-resolution page (any mode; converted to RGB).
        layout: from ``read_layout``; modified in place as described.
        image_analysis: read images and charts with the "Image Analysis" prompt (MinerU2.5-Pro).
    """
    helper = vl_helper()
    crops, prompts, _params, indices = helper.prepare_for_extract(page_image, layout.blocks, None, image_analysis)
    requests = []
    for crop, prompt, index in zip(crops, prompts, indices, strict=True):
        block_type = layout.blocks[index]["type"]
        requests.append(ContentRequest(index, crop, _TASKS.get(block_type, "text"), prompt))
    return requests


@dataclass(frozen=True)
class ContentOutput:
    """What the engine returned for one content request.

    Attributes:
        text: the raw generated text ("" when it failed).
        finish_reason: ``"stop"``, ``"length"``, ``"repetition"`` or ``"error"``.
        error: the error message when ``finish_reason == "error"``.
        logprobs: log-probabilities of the tokens of ``text`` (``GenerationResult.logprobs``, end token left out).
    """

    text: str
    finish_reason: str = "stop"
    error: str | None = None
    logprobs: list[float] | None = None
