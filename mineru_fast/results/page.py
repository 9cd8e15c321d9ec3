"""One page's result: ``Page`` -> ``Block``, the errors and confidence they carry, and the images
cut from a page (crops of its blocks, a layout overlay).

The ``Document`` that holds the pages, and its MinerU-format outputs, is ``results.document``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image, ImageDraw, ImageFont

Status = Literal["success", "partial", "failure"]

NOTEBOOK_MAX_SIDE = 1600  # pixels, long side of a page shown in a notebook (a 200 DPI page is 2200)

_OVERLAY_COLORS = {
    "title": (220, 40, 40),
    "text": (40, 90, 220),
    "table": (20, 160, 60),
    "image": (200, 120, 0),
    "equation": (150, 40, 200),
}


@dataclass(frozen=True)
class ParseError:
    """A problem that cost content: a document that could not be opened, a page that failed.

    Attributes:
        code: stable machine-readable code: the ``code`` of the mineru-fast error behind it
            (``"corrupt_document"``, ``"image_too_large"``, ..., ``errors``), ``"layout_unreadable"``
            (the layout output holds no valid block), ``"engine_error"`` (the engine refused or
            failed a request), ``"internal_error"`` (anything else while assembling a page) or
            ``"batch_task_failed"`` (``mineru-fast batch``: the page's task failed on every attempt)
            or ``"interrupted"`` (a ``DocumentWriter`` closed by an exception: pages are missing).
        message: a sentence for people (``str(error)`` is ``"code: message"``).
        page: 0-based page index, None for a document-level error.
    """

    code: str
    message: str
    page: int | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, page: int | None = None, code: str | None = None) -> ParseError:
        """An error from an exception.

        Args:
            exc: the exception.
            page: 0-based page index, None for the document.
            code: default ``errors.error_code(exc)``: a mineru-fast error's own ``code``, else
                ``"internal_error"``.

        Returns:
            The error; its message is ``str(exc)`` for a mineru-fast error (its code names its
            class), else ``"<exception type>: <exc>"``.
        """
        from mineru_fast.errors import MineruFastError, error_code

        message = str(exc) if isinstance(exc, MineruFastError) else f"{type(exc).__name__}: {exc}"
        return cls(code or error_code(exc), message, page)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "page": self.page}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class Confidence:
    """How probable a block's tokens were under the model: natural-log probabilities of the tokens
    of its raw output (``Block.logprobs``: the model's own distribution before penalties; in replay
    the forced tokens'), the end token left out (it says the block ended, not what it holds).

    Attributes:
        mean_logprob: mean log-probability per token (0 = certain).
        min_logprob: the least probable token's log-probability.
        tokens: tokens the figures are over.
    """

    mean_logprob: float
    min_logprob: float
    tokens: int

    @classmethod
    def of(cls, logprobs: Sequence[float] | None) -> Confidence | None:
        """Figures over ``logprobs``; None when there are none."""
        if not logprobs:
            return None
        return cls(math.fsum(logprobs) / len(logprobs), min(logprobs), len(logprobs))

    @classmethod
    def combine(cls, parts: Iterable[Confidence | None]) -> Confidence | None:
        """Figures over the tokens of several blocks (token-weighted mean, least min)."""
        known = [p for p in parts if p is not None]
        if not known:
            return None
        tokens = sum(p.tokens for p in known)
        mean = math.fsum(p.mean_logprob * p.tokens for p in known) / tokens
        return cls(mean, min(p.min_logprob for p in known), tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"mean_logprob": self.mean_logprob, "min_logprob": self.min_logprob, "tokens": self.tokens}


@dataclass
class Block:
    """One layout block with its content.

    Attributes:
        type: MinerU2.5 block type (``"text"``, ``"title"``, ``"table"``, ...).
        bbox: ``(x1, y1, x2, y2)`` normalized to 0..1 of the page image as displayed.
        angle: text rotation in degrees (0/90/180/270) or None if the model gave none.
        content: final content (text, LaTeX without delimiters, table HTML); None if not read.
        raw: the content step's raw output; None if not read.
        finish_reason: ``"stop"``, ``"length"`` (a bound was hit), ``"repetition"`` (cut by the
            guard), ``"timeout"``/``"cancelled"`` (ended early), ``"error"``, or None if not read.
        error: why this block has no content although it should, else None.
        raw_type: the layout type the model gave when the protocol does not know it (the block is
            then kept as ``text``), else None.
        merge_prev: for text blocks, the model's "continues the previous block" flag
            (``txt_contd_tgt``), else None.
        sub_type: image-analysis class of an image or chart (``natural_image``, ``bar``, ...), else None.
        logprobs: log-probability of each token of ``raw`` (``GenerationResult.logprobs`` without
            the end token); not serialized (``confidence`` summarizes them).
        low_confidence: the block's mean log-probability is below ``ParserOptions.confidence_threshold``.
    """

    type: str
    bbox: tuple[float, float, float, float]
    angle: int | None = None
    content: str | None = None
    raw: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    raw_type: str | None = None
    merge_prev: bool | None = None
    sub_type: str | None = None
    logprobs: list[float] | None = field(default=None, repr=False)
    low_confidence: bool = False

    @property
    def confidence(self) -> Confidence | None:
        """Mean and min log-probability of the block's generated tokens; None if it was not read."""
        return Confidence.of(self.logprobs)

    def to_dict(self) -> dict:
        """JSON-serializable fields; ``raw_type``, ``merge_prev`` and ``sub_type`` only when set."""
        confidence = self.confidence
        out: dict[str, Any] = {
            "type": self.type,
            "bbox": list(self.bbox),
            "angle": self.angle,
            "content": self.content,
            "raw": self.raw,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "confidence": confidence.to_dict() if confidence is not None else None,
            "low_confidence": self.low_confidence,
        }
        for name in ("raw_type", "merge_prev", "sub_type"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class Page:
    """One page: its blocks in reading order, status, problems, timings and counts.

    Attributes:
        index: 0-based page index in the source document.
        size: ``(width, height)`` of the rendered page in pixels (0, 0 if it failed to render).
        errors: what made the page fail (``ParseError``s); warnings: what made it partial (text).
        timings: seconds by stage (``render``, ``vision``, ``prefill``, ``decode``, ``total``).
        counts: the page's engine work: ``requests``, ``prompt_tokens`` (image tokens included)
            and ``generated_tokens`` (end tokens included); with speculative decoding on, also
            ``decode_steps``, ``draft_tokens`` (verified) and ``accepted_tokens`` (of them, the
            model's own choices).
        image: the rendered page (None after a render failure, and once the parser releases it
            unless asked to keep page images); the layout overlay needs it.
        crops: the images the outputs reference (``images/<name>``), cut from the page when the
            parser releases the page image; not serialized.
        tier: the pipeline tier the page went through, ``"standard"`` or ``"advanced"``.
        ocr_mode: where its text-like blocks came from: ``"txt"`` (the PDF's text layer) or
            ``"ocr"`` (the page image, read by the VLM); always ``"ocr"`` on the advanced tier.
        ocr_reason: the text-layer check that decided ``ocr_mode`` (or ``"requested"``).
    """

    index: int
    size: tuple[int, int] = (0, 0)
    blocks: list[Block] = field(default_factory=list)
    status: Status = "success"
    errors: list[ParseError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    layout_raw: str | None = None
    image: Image.Image | None = field(default=None, repr=False)
    crops: dict[str, Image.Image] = field(default_factory=dict, repr=False)
    tier: str | None = None
    ocr_mode: str | None = None
    ocr_reason: str | None = None

    def _repr_png_(self) -> bytes | None:
        """Jupyter shows a page as its layout overlay, long side at most ``NOTEBOOK_MAX_SIDE``
        pixels; None (the text repr) when the page has no image."""
        if self.image is None:
            return None
        overlay = layout_overlay(self)
        overlay.thumbnail((NOTEBOOK_MAX_SIDE, NOTEBOOK_MAX_SIDE))
        buffer = io.BytesIO()
        overlay.save(buffer, format="PNG")
        return buffer.getvalue()

    def to_dict(self) -> dict:
        return {
            "page_idx": self.index,
            "size": list(self.size),
            "status": self.status,
            "errors": [e.to_dict() for e in self.errors],
            "warnings": self.warnings,
            "timings": self.timings,
            "counts": self.counts,
            "tier": self.tier,
            "ocr_mode": self.ocr_mode,
            "ocr_reason": self.ocr_reason,
            "layout_raw": self.layout_raw,
            "blocks": [b.to_dict() for b in self.blocks],
        }


def status_of(errors: Sequence[object], page_statuses: list[str]) -> Status:
    """A document's status from its errors and its pages' statuses."""
    if errors or (page_statuses and all(s == "failure" for s in page_statuses)):
        return "failure"
    if any(s != "success" for s in page_statuses):
        return "partial"
    return "success"


def cut_crops(page: Page, crops: list[tuple[str, tuple[float, float, float, float]]]) -> dict[str, Image.Image]:
    """Cut ``(file name, 0..1 bbox)`` crops out of the page image (empty boxes skipped).

    Raises:
        ValueError: the page has no image.
    """
    if page.image is None:
        raise ValueError(f"page {page.index + 1} has no image")
    width, height = page.size
    out = {}
    for name, (x1, y1, x2, y2) in crops:
        box = (round(x1 * width), round(y1 * height), round(x2 * width), round(y2 * height))
        if box[2] > box[0] and box[3] > box[1]:
            out[name] = page.image.crop(box).convert("RGB")
    return out


def layout_overlay(page: Page) -> Image.Image:
    """The page image with each block's box drawn, colored by type and numbered in reading order."""
    if page.image is None:
        raise ValueError(f"page {page.index + 1} has no image")
    canvas = page.image.convert("RGB")
    draw = ImageDraw.Draw(canvas, "RGBA")
    width, height = canvas.size
    line = max(2, round(max(width, height) / 600))
    font = ImageFont.load_default(size=max(12, 8 * line))
    for n, block in enumerate(page.blocks, start=1):
        color = _OVERLAY_COLORS.get(block.type, (120, 120, 120))
        x1, y1, x2, y2 = block.bbox
        box = (x1 * width, y1 * height, x2 * width, y2 * height)
        draw.rectangle(box, outline=color + (255,), fill=color + (40,), width=line)
        draw.text((box[0] + line, box[1] + line), f"{n} {block.type}", fill=color + (255,), font=font)
    return canvas
