"""MinerU 4's middle JSON of mineru-fast's pages: DocVortex's ``docvortex.middle`` protocol, version 2.0.

The middle JSON is the document MinerU 4 renders every target from (``middle_json.json`` of its
result bundle; ``mineru.parser.base.ParseResult.from_json`` reads it back). A page is
``{"page_idx", "blocks"}``; blocks are the page model (``mineru4.page_model``) in DocVortex's
field order (``docvortex.schema``: ``type``, ``index``, ``bbox``, then ``image_path``, ``content``
and the type's own fields), with the defaults left out as DocVortex's ``to_dict`` leaves them out.
Image, table and chart bodies and equations name their crop (``images/<image_name>``), as
``docvortex.export.materialize_middle`` does for the bundle.

``model_output.json`` (DocVortex's ``docvortex.model``) holds each page's model list after MinerU
4's analysis steps (``model_page``), before the document model groups it.

The document around the pages (``Envelope``) records ``mineru-fast`` as its producer, MinerU 4's
``extensions["mineru"]`` (tier and text mode), the source's properties (``metadata.document``)
and page geometry (``extensions["docvortex_layout"]``, which DocVortex's original-layout PDF
renderer reads) as DocVortex records them, and mineru-fast's own record under
``extensions["mineru_fast"]`` (status, errors, model and protocol, options, timings).

Pure Python: no torch, no DocVortex (which validates these files where it is installed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mineru_fast._version import __version__
from mineru_fast.results.mineru4 import ANGLE_KEY, CONFIDENCE_KEY, _analysis_blocks, page_model
from mineru_fast.results.page import Page

__all__ = [
    "SCHEMA",
    "MODEL_SCHEMA",
    "SCHEMA_VERSION",
    "PRODUCER",
    "image_name",
    "middle_blocks",
    "middle_page",
    "page_entry",
    "model_page",
    "image_rotations",
    "LAYOUT_EXTENSION",
    "Envelope",
]

SCHEMA = "docvortex.middle"  # docvortex.schema.MiddleJson.schema_id
MODEL_SCHEMA = "docvortex.model"  # docvortex.schema.ModelJson.schema_id (model_output.json)
SCHEMA_VERSION = "2.0"  # docvortex.schema.DocumentModel.schema_version (docvortex 0.6.4)
PRODUCER = "mineru-fast"
LAYOUT_EXTENSION = "docvortex_layout"  # docvortex.document.pdf.layout.LAYOUT_EXTENSION (version 1)

_BODIES = {"image_body": "image", "table_body": "table", "chart_body": "chart"}
# Block types whose schema has a sub_type (docvortex.schema: ListBlock, ImageBlock, ChartBlock, CodeBlock).
_WITH_SUB_TYPE = {"list", "image", "chart", "code"}
# mineru-fast tiers -> MinerU 4 product tiers (mineru.integrations.docvortex.MinerUMetadata).
_TIERS = {"advanced": "advanced", "standard": "standard"}


def image_name(page_idx: int, kind: str, index: int) -> str:
    """The crop file of a block under ``images/``: ``page_<page_idx>_<kind>_<index>.jpg``, as
    mineru 4.0.12 names it (``kind``: image, table, chart or equation; ``index``: the block's
    position in the page's model list)."""
    return f"page_{page_idx}_{kind}_{index}.jpg"


def _spans(spans: list[dict]) -> list[dict]:
    return [{"type": span["type"], "content": span["content"]} for span in spans if span.get("content")]


def _block(entry: dict, page_idx: int, visual: str | None = None) -> dict[str, Any]:
    """One page-model entry (and its children) in the middle JSON's field order."""
    kind = entry["type"]
    if kind == "code_body" and visual == "algorithm":
        kind = "algorithm_body"
    out: dict[str, Any] = {"type": kind}
    if entry.get("index") is not None:
        out["index"] = entry["index"]
    if entry.get("bbox") is not None:
        out["bbox"] = [float(v) for v in entry["bbox"]]
    content = entry.get("content")
    if kind in _BODIES or kind == "equation":
        out["image_path"] = f"images/{image_name(page_idx, _BODIES.get(kind, 'equation'), entry['index'])}"
    if kind in ("image", "table", "chart", "code", "list", "index"):
        sub = entry.get("sub_type") if kind == "code" else None
        out["content"] = [_block(child, page_idx, sub) for child in content or []]
    elif isinstance(content, list):
        out["content"] = _spans(content)
    else:
        out["content"] = content or ""
    if kind in ("doc_title", "paragraph_title"):
        out["level"] = entry["level"]
    if kind in _WITH_SUB_TYPE and entry.get("sub_type"):
        out["sub_type"] = entry["sub_type"]
    if kind == "code":
        out["sub_type"] = entry.get("sub_type") or "code"
        if out["sub_type"] == "code":
            out["guess_lang"] = "txt"  # MinerU 4 guesses it with Magika (a model); see the README
    return out


def middle_blocks(entries: list[dict], page_idx: int) -> list[dict[str, Any]]:
    """Page-model entries (``mineru4.page_model``) as middle JSON blocks of page ``page_idx``
    (private keys such as the confidence record left out)."""
    return [_block({k: v for k, v in e.items() if k not in (CONFIDENCE_KEY, ANGLE_KEY)}, page_idx) for e in entries]


def page_entry(page: dict[str, Any]) -> dict[str, Any]:
    """A page of the middle JSON as the file holds it: a page without blocks is ``{"page_idx": N}``
    (DocVortex's ``MiddleJson.to_dict`` leaves defaults out, and the empty block list is one; its
    structured content keeps ``"blocks": []``), any other page as it is."""
    return page if page.get("blocks") else {k: v for k, v in page.items() if k != "blocks"}


def image_rotations(entries: list[dict]) -> dict[str, int]:
    """The crops of a page that were turned upright: ``{str(index): angle}`` for each crop-bearing
    block (an image, table or chart body, an equation) of the page model ``entries``
    (``mineru4.page_model``) whose layout block was rotated by 90, 180 or 270 degrees, by its
    position in the model list, ascending; as DocVortex's ``attach_layout_image_rotations`` records
    them in ``extensions.docvortex_layout`` (its original-layout renderer turns them back)."""
    found: dict[int, int] = {}
    for entry in entries:
        for item in [entry, *(entry["content"] if isinstance(entry.get("content"), list) else [])]:
            kind = item.get("type")
            if (kind in _BODIES or kind == "equation") and item.get(ANGLE_KEY) in (90, 180, 270):
                found[item["index"]] = item[ANGLE_KEY]
    return {str(index): found[index] for index in sorted(found)}


def middle_page(page: Page) -> dict[str, Any]:
    """One page of the middle JSON: ``{"page_idx": page.index, "blocks": [...]}``."""
    return {"page_idx": page.index, "blocks": middle_blocks(page_model(page.blocks), page.index)}


def model_page(page: Page) -> list[dict[str, Any]]:
    """One page of ``model_output.json``: the page's blocks after MinerU 4's analysis steps
    (``mineru4``: generic captions and footnotes, titles split, formula numbers merged, text as
    spans), each ``{"type", "bbox", "content"}`` plus its ``level`` or ``sub_type``."""
    out = []
    for item in _analysis_blocks(page.blocks):
        block: dict[str, Any] = {"type": item["type"], "bbox": [float(v) for v in item["bbox"]]}
        content = item.get("content")
        block["content"] = _spans(content) if isinstance(content, list) else content or ""
        for key in ("level", "sub_type"):
            if item.get(key) is not None:
                block[key] = item[key]
        out.append(block)
    return out


# docvortex.schema.DocumentProperties with its defaults (model_output.json writes them all).
_PROPERTIES: dict[str, Any] = {
    "title": None, "authors": [], "subject": None, "keywords": [], "description": None, "languages": [],
    "identifiers": [], "publisher": None, "created_at": None, "modified_at": None,
    "creator_application": None, "producer_application": None, "page_count": None, "page_count_kind": None,
}  # fmt: skip


@dataclass
class Envelope:
    """The document around a middle JSON's pages, and the two ways it is written.

    Attributes:
        page_count: pages in the whole source document (``metadata.document.page_count``).
        full: every page of the source was parsed (``is_full_document``).
        tier: mineru-fast's tier (``"advanced"`` or ``"standard"``), or None when unknown.
        parse_mode: ``"ocr"`` (text read from the page image) or ``"txt"`` (the PDF's text layer).
        record: mineru-fast's own record (``metadata.head_dict``'s fields), ``extensions["mineru_fast"]``.
        version: mineru-fast's version (the producer's).
        pdf: the source is a PDF; an image has no document properties (MinerU 4 writes ``{}``).
        properties: what the PDF declares (``InputInfo.properties``), ``metadata.document``'s
            fields before the page count.
        geometry: per source page, ``{"page_idx", "width_pt", "height_pt"}``
            (``InputInfo.page_geometry``): ``extensions.docvortex_layout``'s pages; None writes
            no such extension (a result read back from a file that had none).
        rotations: per page index, the crops turned upright on it (``image_rotations``), added
            to its geometry as ``image_rotations`` where there are any.
    """

    page_count: int
    full: bool
    tier: str | None
    parse_mode: str
    record: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    pdf: bool = True
    properties: dict[str, Any] = field(default_factory=dict)
    geometry: list[dict[str, Any]] | None = None
    rotations: dict[int, dict[str, int]] = field(default_factory=dict)

    def layout_extension(self) -> dict[str, Any] | None:
        """``extensions.docvortex_layout``: ``{"version": 1, "pages": [...]}``, or None without
        ``geometry``."""
        if self.geometry is None:
            return None
        pages = []
        for page in self.geometry:
            rotations = self.rotations.get(page["page_idx"])
            pages.append({**page, "image_rotations": rotations} if rotations else dict(page))
        return {"version": 1, "pages": pages}

    def _head(self) -> dict[str, Any]:
        if not self.version:
            self.version = __version__
        document = {}
        if self.pdf:
            document = {**self.properties, "page_count": self.page_count, "page_count_kind": "physical"}
        extensions: dict[str, Any] = {}
        if self.tier in _TIERS:
            extensions["mineru"] = {"tier": _TIERS[self.tier], "parse_mode": self.parse_mode}
        if (layout := self.layout_extension()) is not None:
            extensions[LAYOUT_EXTENSION] = layout
        extensions["mineru_fast"] = self.record
        return {
            # file_suffix: MinerU 4 reads images as one-page PDFs, so every result is "pdf"
            "metadata": {"file_suffix": "pdf", "producer": {"name": PRODUCER, "version": self.version},
                         "document": document},
            "extensions": extensions,
        }  # fmt: skip

    def middle_json(self, pages: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole middle JSON around ``pages`` (``middle_page``'s), as a dict."""
        tail = {"is_full_document": self.full, "schema": SCHEMA, "schema_version": SCHEMA_VERSION}
        return {**self._head(), "pages": [page_entry(p) for p in pages], **tail}

    def structured_content(self, pages: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole ``structured_content.json`` around its ``pages``, as a dict."""
        return {"pages": pages, **self._head(), "is_full_document": self.full}

    def middle_parts(self) -> tuple[str, str]:
        """``(before, after)`` the pages array of ``json.dumps(middle, ensure_ascii=False,
        indent=2)``: the text up to ``"pages": `` and from the array's end on."""
        head = json.dumps(self._head(), ensure_ascii=False, indent=2)
        tail = {"is_full_document": self.full, "schema": SCHEMA, "schema_version": SCHEMA_VERSION}
        rest = json.dumps(tail, ensure_ascii=False, indent=2)
        return head[:-2] + ',\n  "pages": ', ",\n" + rest[2:]

    def model_parts(self, pages: list[int]) -> tuple[str, str]:
        """``(before, after)`` the pages array of ``model_output.json`` (DocVortex's ModelJson
        with every default written, as ``ParseResult.save`` writes it); ``pages`` are the source
        pages written, the ``page_index_map`` of a partial document."""
        head = self._head()
        head["metadata"]["document"] = {**_PROPERTIES, **head["metadata"]["document"]}
        head["extensions"] = {k: v for k, v in head["extensions"].items() if k != "mineru_fast"}
        text = json.dumps(
            {**head, "schema_version": SCHEMA_VERSION, "schema": MODEL_SCHEMA}, ensure_ascii=False, indent=2
        )
        tail = json.dumps({"page_index_map": [] if self.full else pages}, indent=2)
        return text[:-2] + ',\n  "pages": ', ",\n" + tail[2:]

    def structured_tail(self) -> str:
        """What follows the pages array of ``structured_content.json`` (DocVortex's
        ``render_structured_content``: the document's fields but its schema identity)."""
        fields = {**self._head(), "is_full_document": self.full}
        return ",\n" + json.dumps(fields, ensure_ascii=False, indent=2)[2:]
