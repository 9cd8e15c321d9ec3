"""The parse result: ``Document`` -> ``Page`` -> ``Block``, and its MinerU-format outputs.

Outputs match what MinerU users already consume: ``<stem>.md`` (paratext left out),
``<stem>_content_list.json`` (one item per body block, bbox as integers on a 0..1000 scale,
``page_idx``, ``text_level`` for titles, ``img_path``, ``table_body``, captions and footnotes
grouped with their image or table), ``images/`` with crops of image, table and equation blocks,
plus ``<stem>.json`` (everything, including timings and errors) and a layout overlay PNG per page.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw, ImageFont

from .protocol import PARATEXT_TYPES

Status = Literal["success", "partial", "failure"]

NOTEBOOK_MAX_SIDE = 1600  # pixels, long side of a page shown in a notebook (a 200 DPI page is 2200)
CROPPED_TYPES = ("image", "table", "equation")
"""Block types whose crop is written to ``images/`` (and kept on ``Block.image`` after parsing)."""
_CAPTION_OWNER = {
    "image_caption": "image",
    "image_footnote": "image",
    "table_caption": "table",
    "table_footnote": "table",
    "code_caption": "code",
}
_OVERLAY_COLORS = {
    "title": (220, 40, 40),
    "text": (40, 90, 220),
    "table": (20, 160, 60),
    "image": (200, 120, 0),
    "equation": (150, 40, 200),
}


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
        logprobs: log-probability of each generated token (see ``GenerationResult.logprobs``);
            not serialized.
        image: the block's crop of the rendered page (``CROPPED_TYPES`` only), kept so the
            outputs can be written after the page image is gone; not serialized.
    """

    type: str
    bbox: tuple[float, float, float, float]
    angle: int | None = None
    content: str | None = None
    raw: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = field(default=None, repr=False)
    image: Image.Image | None = field(default=None, repr=False)

    def bbox_1000(self) -> list[int]:
        """The bbox as integers on MinerU's 0..1000 scale."""
        return [round(v * 1000) for v in self.bbox]

    @classmethod
    def from_dict(cls, data: dict) -> Block:
        """The inverse of ``to_dict`` (images and log-probs are not serialized)."""
        x1, y1, x2, y2 = data["bbox"]
        fields = ("angle", "content", "raw", "finish_reason", "error")
        return cls(data["type"], (x1, y1, x2, y2), **{k: data.get(k) for k in fields})

    def to_dict(self) -> dict:
        return {
            "type": self.type,
            "bbox": list(self.bbox),
            "angle": self.angle,
            "content": self.content,
            "raw": self.raw,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclass
class Page:
    """One page: its blocks in reading order, status, problems and timings (seconds).

    Attributes:
        index: 0-based page index in the source document.
        size: ``(width, height)`` of the rendered page in pixels (0, 0 if it failed to render).
        image: the rendered page, kept so ``Document.save`` can write crops and overlays; None
            after a render failure.
    """

    index: int
    size: tuple[int, int] = (0, 0)
    blocks: list[Block] = field(default_factory=list)
    status: Status = "success"
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    layout_raw: str | None = None
    image: Image.Image | None = field(default=None, repr=False)

    def crop_name(self, block_idx: int) -> str:
        return f"page{self.index + 1:04d}_block{block_idx:03d}_{self.blocks[block_idx].type}.jpg"

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

    @classmethod
    def from_dict(cls, data: dict) -> Page:
        """The inverse of ``to_dict`` (without the image)."""
        width, height = data["size"]
        return cls(
            data["page_idx"],
            (width, height),
            [Block.from_dict(b) for b in data["blocks"]],
            data["status"],
            list(data["errors"]),
            list(data["warnings"]),
            dict(data["timings"]),
            data["layout_raw"],
        )

    def to_dict(self) -> dict:
        return {
            "page_idx": self.index,
            "size": list(self.size),
            "status": self.status,
            "errors": self.errors,
            "warnings": self.warnings,
            "timings": self.timings,
            "layout_raw": self.layout_raw,
            "blocks": [b.to_dict() for b in self.blocks],
        }


def _distance(bbox: tuple[float, float, float, float], point: tuple[float, float]) -> float:
    """L1 distance from a point to a box (0 inside)."""
    x1, y1, x2, y2 = bbox
    x, y = point
    return max(x1 - x, 0, x - x2) + max(y1 - y, 0, y - y2)


def _attach_captions(blocks: list[Block]) -> tuple[list[int], dict[int, list[int]]]:
    """Group caption/footnote blocks with the nearest body of their kind on the page.

    Returns:
        ``(items, attached)``: indices of blocks that stand on their own, in reading order, and for
        each body index the indices of its captions/footnotes (in reading order). A caption with no
        body of its kind on the page stands on its own.
    """
    attached: dict[int, list[int]] = {}
    items: list[int] = []
    for i, block in enumerate(blocks):
        owner_type = _CAPTION_OWNER.get(block.type)
        owners = [j for j, b in enumerate(blocks) if b.type == owner_type] if owner_type else []
        if not owners:
            items.append(i)
            continue
        center = ((block.bbox[0] + block.bbox[2]) / 2, (block.bbox[1] + block.bbox[3]) / 2)
        nearest = min(owners, key=lambda j, c=center: _distance(blocks[j].bbox, c))
        attached.setdefault(nearest, []).append(i)
    return items, attached


def _texts(blocks: list[Block], indices: list[int], kind: str) -> list[str]:
    return [blocks[i].content or "" for i in indices if blocks[i].type.endswith(kind)]


@dataclass
class Document:
    """Result of parsing one document.

    Attributes:
        name: source stem, used for output file names.
        status: ``success`` (every page fine), ``partial`` (some pages or blocks failed) or
            ``failure`` (no page could be parsed, or the input could not be opened).
        errors: document-level errors (input errors); page problems are on the pages.
        timings: seconds by stage, summed over pages (``vision``, ``prefill``, ``decode``, ...).
    """

    name: str
    pages: list[Page] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        return self.status_of(self.errors, [p.status for p in self.pages])

    @staticmethod
    def status_of(errors: list[str], page_statuses: list[str]) -> Status:
        """A document's status from its errors and its pages' statuses."""
        if errors or (page_statuses and all(s == "failure" for s in page_statuses)):
            return "failure"
        if any(s != "success" for s in page_statuses):
            return "partial"
        return "success"

    def to_markdown(self, image_dir: str = "images") -> str:
        """MinerU-style Markdown: titles as ``#`` headings, equations as ``$$`` blocks, tables as
        HTML with their captions and footnotes, images as links to ``image_dir`` crops. Paratext
        (headers, footers, page numbers, side notes, page footnotes) is left out."""
        parts = (self.page_markdown(page, image_dir) for page in self.pages)
        return "\n\n".join(p for p in parts if p) + "\n"

    @classmethod
    def page_markdown(cls, page: Page, image_dir: str = "images") -> str:
        """One page's part of ``to_markdown`` (without the final newline)."""
        parts: list[str] = []
        items, attached = _attach_captions(page.blocks)
        for i in items:
            parts.extend(cls._markdown_item(page, i, attached.get(i, []), image_dir))
        return "\n\n".join(p for p in parts if p)

    @staticmethod
    def _markdown_item(page: Page, i: int, extras: list[int], image_dir: str) -> list[str]:
        block = page.blocks[i]
        text = block.content or ""
        captions = _texts(page.blocks, extras, "_caption")
        footnotes = _texts(page.blocks, extras, "_footnote")
        if block.type in PARATEXT_TYPES:
            return []
        if block.type == "title":
            return [f"# {text}" if text else ""]
        if block.type == "equation":
            return [f"$$\n{text}\n$$" if text else ""]
        if block.type == "image":
            return [f"![]({image_dir}/{page.crop_name(i)})", *captions, *footnotes]
        if block.type == "table":
            return [*captions, text, *footnotes]
        if block.type in ("code", "algorithm"):
            return [*captions, f"```\n{text}\n```" if text else ""]
        return [text]

    def to_content_list(self, image_dir: str = "images") -> list[dict]:
        """MinerU's ``content_list.json`` items, in reading order, paratext included."""
        return [item for page in self.pages for item in self.page_content_list(page, image_dir)]

    @staticmethod
    def page_content_list(page: Page, image_dir: str = "images") -> list[dict]:
        """One page's items of ``to_content_list``."""
        out: list[dict] = []
        items, attached = _attach_captions(page.blocks)
        for i in items:
            block, extras = page.blocks[i], attached.get(i, [])
            item: dict = {"type": block.type}
            if block.type in ("image", "table"):
                item["img_path"] = f"{image_dir}/{page.crop_name(i)}"
                item[f"{block.type}_caption"] = _texts(page.blocks, extras, "_caption")
                item[f"{block.type}_footnote"] = _texts(page.blocks, extras, "_footnote")
                if block.type == "table":
                    item["table_body"] = block.content or ""
            elif block.type == "equation":
                item.update(img_path=f"{image_dir}/{page.crop_name(i)}", text_format="latex")
                item["text"] = f"$$\n{block.content}\n$$" if block.content else ""
            elif block.type in ("code", "algorithm"):
                item.update(type="code", sub_type=block.type, code_body=block.content or "")
                item["code_caption"] = _texts(page.blocks, extras, "_caption")
            else:
                if block.type not in PARATEXT_TYPES:
                    item["type"] = "text"
                item["text"] = block.content or ""
                if block.type == "title":
                    item["text_level"] = 1
            item["bbox"] = block.bbox_1000()
            item["page_idx"] = page.index
            out.append(item)
        return out

    def to_dict(self) -> dict:
        """Everything, JSON-serializable: status, errors, timings, pages with raw outputs."""
        return {
            "name": self.name,
            "status": self.status,
            "errors": self.errors,
            "timings": self.timings,
            "pages": [p.to_dict() for p in self.pages],
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``<stem>.md``, ``<stem>_content_list.json``, ``<stem>.json``, ``images/`` crops of
        image/table/equation blocks and ``layout/page_NNNN.png`` overlays into ``out_dir``.

        Returns:
            ``out_dir`` as a Path (created if needed).
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.name}.md").write_text(self.to_markdown(), encoding="utf-8")
        content_list = json.dumps(self.to_content_list(), ensure_ascii=False, indent=2)
        (out / f"{self.name}_content_list.json").write_text(content_list, encoding="utf-8")
        (out / f"{self.name}.json").write_text(
            json.dumps(self.to_dict(), ensure_ascii=False, indent=2), encoding="utf-8"
        )
        for page in self.pages:
            save_page_images(page, out)
        return out

    def _repr_markdown_(self) -> str:  # Jupyter renders a Document as its Markdown
        return self.to_markdown()


def save_page_images(page: Page, out: Path) -> None:
    """Write a page's block crops to ``out/images/`` and, when the page image is at hand, its
    layout overlay to ``out/layout/page_NNNN.png``."""
    width, height = page.size
    for i, block in enumerate(page.blocks):
        if block.type not in CROPPED_TYPES:
            continue
        crop = block.image
        if crop is None and page.image is not None:
            x1, y1, x2, y2 = block.bbox
            crop = page.image.crop((round(x1 * width), round(y1 * height), round(x2 * width), round(y2 * height)))
        if crop is not None:
            (out / "images").mkdir(exist_ok=True)
            crop.save(out / "images" / page.crop_name(i), quality=90)
    if page.image is not None:
        (out / "layout").mkdir(exist_ok=True)
        layout_overlay(page).save(out / "layout" / f"page_{page.index + 1:04d}.png")


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
