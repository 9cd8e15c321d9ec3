"""MinerU 4's outputs, rendered page by page: Markdown, structured content, the content list, and
the pages of the middle JSON (``middle``); ``DocumentWriter`` writes them as MinerU 4's result
bundle (default) or in MinerU 2.x's layout.

Facts follow mineru 4.0.12's writer (docvortex's Markdown renderer and mineru's content list V1):
text escaped conservatively (``* _ ` ~ $`` and a leading block marker), inline math as ``$..$``,
display math as ``$$`` blocks, headings from title levels, simple tables as pipe tables and the rest
as HTML, page footnotes as small HTML spans, headers / footers / page numbers / side notes only in
the content list, images named ``images/page_<page>_<kind>_<index>.jpg``.

``render_page`` is all a streaming writer needs: one finished ``Page`` in, its Markdown chunk, its
content-list items, its middle JSON and structured-content pages, its crops and its blocks'
Markdown pieces out; a ``MarkdownJoiner`` fed the pieces page after page joins what continues
across pages (reference lists, tables) as official's middle JSON marks it (``continues_prev``,
which it marks in the middle JSON pages too). ``DocumentWriter`` writes a document that way,
keeping no page image after the page is written.

Extension (off by default, so the outputs stay MinerU's byte for byte): with ``confidence=True``
every content-list item and structured-content block gets ``mf_confidence``: ``{"mean_logprob", "min_logprob", "tokens",
"low_confidence"}`` over the tokens of the blocks it was made from (``document.Confidence``), or None
when none of them was read by the model.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import textwrap
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mineru_fast.errors import OutputError
from mineru_fast.results.metadata import head_dict
from mineru_fast.results.middle import Envelope, image_name, image_rotations, middle_blocks, model_page, page_entry
from mineru_fast.results.mineru4 import CONFIDENCE_KEY, TRANSPARENT, page_model, plain_text
from mineru_fast.results.page import Confidence, Page, ParseError, cut_crops, layout_overlay, status_of
from mineru_fast.results.table_markdown import format_embedded_html, render_table
from mineru_fast.results.table_merge import can_merge_tables, merge_tables

__all__ = [
    "PageOutput",
    "render_page",
    "render_markdown",
    "render_pages",
    "mark_continuations",
    "MarkdownJoiner",
    "MarkdownPiece",
    "DocumentWriter",
    "LAYOUTS",
    "BUNDLE_FILES",
    "render_spans",
    "remove_outputs",
    "remove_bundle",
    "envelope_for",
    "page_summary",
    "write_page_images",
]

_AUXILIARY = {"header", "footer", "page_number", "aside_text"}
CONFIDENCE_FIELD = "mf_confidence"  # the content-list extension field (see the module docstring)


@dataclass
class PageOutput:
    """What one page contributes to a document's outputs.

    Attributes:
        markdown: the page's Markdown ("" when it has nothing to show).
        content_list: its ``content_list.json`` items.
        crops: ``(file name under images/, bbox as 0..1 floats)`` of the crops it references.
        middle: the page of the middle JSON (``middle.middle_page``'s layout), what continues
            within the page marked ``continues_prev`` (``mark_continuations`` marks what a
            document's ``MarkdownJoiner`` finds continuing across pages).
        structured: the page of ``structured_content.json`` (DocVortex's structured content),
            marked as ``middle`` is.
        pieces: the Markdown of each top-level block, for ``MarkdownJoiner`` (which joins what
            continues across blocks and pages); one per block of ``middle``, in its order.
        rotations: its crops turned upright (``middle.image_rotations``), for the document's
            ``extensions.docvortex_layout``.
    """

    markdown: str
    content_list: list[dict] = field(default_factory=list)
    crops: list[tuple[str, tuple[float, float, float, float]]] = field(default_factory=list)
    middle: dict = field(default_factory=dict)
    structured: dict = field(default_factory=dict)
    pieces: list[MarkdownPiece] = field(default_factory=list)
    rotations: dict[str, int] = field(default_factory=dict)


@dataclass
class MarkdownPiece:
    """The Markdown of one top-level block of a page.

    Attributes:
        text: its Markdown on its own ("" when it shows nothing).
        kind: ``"ref_list"`` (a reference list, which a following one continues), ``"table"`` (a
            table, which one at the top of the next page may continue), ``"transparent"`` (page
            furniture and page footnotes: they never break a continuation) or ``"block"``.
        page_index: the page it is on.
        block: its page-model block (``mineru4.page_model``).
        render: renders a block of this page (used when a continuation changed ``block``).
        continues_prev: set by ``MarkdownJoiner`` when official's middle JSON marks the block as
            continuing the list or table before it (its ``continues_prev``).
    """

    text: str
    kind: str
    page_index: int
    block: dict
    render: Callable[[dict], str]
    continues_prev: bool = False


# ---------------------------------------------------------------- inline text


_HTML_LIKE = re.compile(r"</?[A-Za-z][^<>\n]*>|<!--.*?-->|<![A-Za-z][^<>\n]*>|<\?[^<>\n]*\?>")
_ENTITY_LIKE = re.compile(r"&(?:#[xX][0-9A-Fa-f]+|#[0-9]+|[A-Za-z][A-Za-z0-9]+);?")
_BLOCK_PREFIX = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<marker>#{1,6}|[+-])(?=[ \t])")


def _escape_markdown_chars(text: str) -> str:
    """Backslash before ``* _ ` ~ $`` unless already escaped by an odd run of backslashes.

    Mirrors docvortex ``render._internal.markdown.escaping.escape_conservative_markdown_text``.
    """
    out, backslashes = [], 0
    for char in text:
        if char == "\\":
            out.append(char)
            backslashes += 1
            continue
        if char in "*_`~$" and backslashes % 2 == 0:
            out.append("\\")
        out.append(char)
        backslashes = 0
    return "".join(out)


def _escape_entities(text: str) -> str:
    """``&`` of text an HTML parser would read as a reference made ``&amp;`` (docvortex
    ``render._internal.markdown.inline._escape_entity_like_text``)."""
    return _ENTITY_LIKE.sub(
        lambda m: f"&amp;{m.group(0)[1:]}" if html.unescape(m.group(0)) != m.group(0) else m.group(0), text
    )


def _escape_text(text: str) -> str:
    """Plain text as Markdown: characters escaped, tag-like text made inert (docvortex
    ``render._internal.markdown.inline._escape_plain_markdown_text``)."""
    parts, cursor = [], 0
    for match in _HTML_LIKE.finditer(text):
        parts.append(_escape_entities(_escape_markdown_chars(text[cursor : match.start()])))
        parts.append(html.escape(match.group(0), quote=False))
        cursor = match.end()
    parts.append(_escape_entities(_escape_markdown_chars(text[cursor:])))
    return "".join(parts)


def render_spans(spans: list[dict]) -> str:
    """Markdown of text / inline-equation spans: text escaped, equations as ``$..$``.

    Mirrors docvortex ``render._internal.markdown.inline.render_inline_spans``.
    """
    return "".join(_escape_text(s["content"]) if s["type"] == "text" else f"${s['content']}$" for s in spans)


def _escape_prefix(text: str) -> str:
    """A leading ``#``/``-``/``+`` block marker escaped (docvortex
    ``render._internal.markdown.escaping.escape_text_block_markdown_prefix``)."""
    match = _BLOCK_PREFIX.match(text)
    return f"{text[: match.start('marker')]}\\{text[match.start('marker') :]}" if match else text


def _escape_rule(text: str) -> str:
    """A line of only ``_`` or only ``-`` escaped (docvortex ``escaping.escape_standalone_marker_rule``)."""
    return f"\\{text}" if text and (set(text) == {"_"} or set(text) == {"-"}) else text


# ---------------------------------------------------------------- blocks


_image_name = image_name


def _overlay_name(page_idx: int) -> str:
    return f"page_{page_idx + 1:04d}.png"


# What a DocumentWriter puts in its subfolders: the names of _image_name and _overlay_name.
_WRITTEN_IN = {"images": re.compile(r"page_\d+_[a-z]+_\d+\.jpg"), "layout": re.compile(r"page_\d{4,}\.png")}


def _join(parts: list[str]) -> str:
    return "\n\n".join(p.strip("\n") for p in parts if p and p.strip())


def _details(content: str, summary: str) -> str:
    """A collapsed HTML details block (docvortex ``markdown.blocks._render_details``)."""
    return f"<details>\n<summary>{html.escape(summary, quote=False)}</summary>\n\n{content.strip()}\n</details>"


def _content(block: dict) -> Any:
    """A block's ``content``: spans (list of dicts), a string, child blocks, or None by type."""
    return block.get("content")


class _PageRenderer:
    def __init__(self, page: Page, image_dir: str) -> None:
        self.page, self.image_dir = page, image_dir
        self.crops: list[tuple[str, tuple[float, float, float, float]]] = []

    def image(self, kind: str, block: dict) -> str:
        name = _image_name(self.page.index, kind, block["index"])
        self.crops.append((name, tuple(block["bbox"])))
        return f"{self.image_dir}/{name}"

    # -- markdown
    def markdown(self, block: dict) -> str:
        """A top-level block's Markdown (docvortex ``markdown.blocks.render_planned_block``)."""
        kind, content = block["type"], _content(block)
        if kind in _AUXILIARY:
            return ""
        if kind in ("text", "ref_text"):
            return _escape_rule(_escape_prefix(render_spans(content)) if kind == "text" else render_spans(content))
        if kind in ("doc_title", "paragraph_title"):
            return f"{'#' * min(max(block['level'], 1), 6)} {render_spans(content)}"
        if kind == "page_footnote":
            text = _escape_rule(_escape_prefix(render_spans(content)))
            if not text.strip():
                return ""
            text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
            attrs = 'class="docvortex-page-footnote" data-block-type="page_footnote" style="color:#6b7280"'
            return f"<small><span {attrs}>{text}</span></small>"
        if kind == "equation":
            latex = (content or "").strip()
            return f"$$\n{latex}\n$$" if latex else f"![]({self.image('equation', block)})"
        if kind == "list":
            return self.list_markdown(block)
        if kind == "index":
            lines = [render_spans(strip_index_page_tail(child["content"])).strip() for child in content]
            return "\n".join(f"- {line}" for line in lines if line)
        if kind in ("image", "table", "chart", "code"):
            return _join([self.visual_child(block, child) for child in content])
        return render_spans(content) if isinstance(content, list) else ""

    def list_markdown(self, block: dict) -> str:
        """A list's Markdown, reference lists bulleted when mostly unnumbered (docvortex
        ``markdown.blocks._render_list``)."""
        children = block["content"]
        bullets = block.get("sub_type") == "ref_text" and _needs_bullets(children)
        lines = []
        for child in children:
            item = render_spans(child["content"])
            if not item:
                continue
            item_lines = _escape_rule(item).splitlines() or [item]
            if bullets and not _UNORDERED_MARKER.match(plain_text(child["content"])):
                lines.append(f"- {item_lines[0]}")
                lines.extend(f"  {line}" for line in item_lines[1:])
            else:
                lines.extend(item_lines)
        return "\n".join(lines)

    def visual_child(self, group: dict, child: dict) -> str:
        """One child of an image, table, chart or code group (docvortex
        ``markdown.blocks._render_visual_body_child``)."""
        kind = child["type"]
        if not kind.endswith("_body"):
            return _escape_rule(render_spans(child["content"]))
        visual, content = group["type"], _content(child)
        if visual == "table":
            rendered = render_table(content) if content else None
            if rendered is None and content:
                rendered = _fenced(content)
            return rendered or f"![]({self.image('table', group)})"
        if visual == "image":
            parts = [f"![]({self.image('image', group)})"]
            if content and content.strip():
                parts.append(_details(format_embedded_html(content.strip()), group.get("sub_type") or "image content"))
            return "\n\n".join(parts)
        if visual == "chart":
            source = self.image("chart", group)
            if content and content.strip():
                rendered = render_table(content.strip()) or format_embedded_html(content.strip())
                return f"![]({source})\n\n{_details(rendered, group.get('sub_type') or 'chart content')}"
            return f"![]({source})"
        # code: plain code in a fence (language not guessed, see README), algorithms with their math
        if group.get("sub_type") == "algorithm":
            return _algorithm_html(content)
        return _fenced(content or "", "txt")

    # -- content list
    def item(self, block: dict) -> dict | None:
        """A block's content-list item (mineru ``render._internal.content_list.v1._render_unit_content``)."""
        kind, content = block["type"], _content(block)
        if kind == "text":
            item: dict = {"type": "text", "text": render_spans(content)}
        elif kind in ("doc_title", "paragraph_title"):
            item = {"type": "text", "text": render_spans(content), "text_level": block["level"]}
        elif kind == "page_footnote":
            item = {"type": "page_footnote", "text": render_spans(content)}
        elif kind in _AUXILIARY:
            item = {"type": kind, "text": render_spans(content)}
        elif kind == "equation":
            item = {"type": "equation", "img_path": self.image("equation", block)}
            if latex := (content or "").strip():
                item.update(text=latex, text_format="latex")
        elif kind == "list":
            items = [render_spans(child["content"]) for child in content if child["content"]]
            item = {"type": "list", "sub_type": block.get("sub_type") or "text", "list_items": items}
        elif kind == "index":
            lines = [render_spans(strip_index_page_tail(child["content"])).strip() for child in content]
            item = {"type": "index", "list_items": [f"- {line}" for line in lines if line]}
        elif kind in ("image", "table", "chart"):
            item = self.visual_item(block)
        elif kind == "code":
            body = next(c for c in content if c["type"] == "code_body")
            algorithm = block.get("sub_type") == "algorithm"
            item = {
                "type": "code",
                "sub_type": "algorithm" if algorithm else "code",
                "code_body": render_spans(body["content"]) if algorithm else body["content"],
                "code_caption": _annotations(block, "code_caption"),
                "code_footnote": _annotations(block, "code_footnote"),
            }
        else:
            return None
        item["bbox"] = [int(v * 1000) for v in block["bbox"]]
        item["page_idx"] = self.page.index
        return item

    def visual_item(self, group: dict) -> dict:
        """An image, table or chart item (mineru ``content_list.v1._render_image`` / ``_render_table``
        / ``_render_chart``)."""
        visual = group["type"]
        body = next(c for c in group["content"] if c["type"] == f"{visual}_body")
        content = format_embedded_html(body.get("content") or "").strip()
        item = {"type": visual, "img_path": self.image(visual, group)}
        if visual == "chart":
            item["content"] = content
        item[f"{visual}_caption"] = _annotations(group, f"{visual}_caption")
        item[f"{visual}_footnote"] = _annotations(group, f"{visual}_footnote")
        if visual == "image" and content:
            item["content"] = content
        if visual == "table" and content:
            item["table_body"] = content
        if visual in ("image", "chart") and group.get("sub_type"):
            item["sub_type"] = group["sub_type"]
        return item

    # -- structured content (docvortex render/_internal/structured_content/renderer.py)
    def structured(self, block: dict) -> dict:
        """A top-level block of ``structured_content.json``: its fields but content, index and
        image payloads, then ``content`` as Markdown; visuals also ``captions``, ``footnotes`` and
        ``image_source``, equations ``image_source``."""
        kind, content = block["type"], _content(block)
        item: dict = {"type": kind, "bbox": [float(v) for v in block["bbox"]]}
        if kind in ("doc_title", "paragraph_title"):
            item["level"] = block["level"]
        if kind in ("list", "image", "chart", "code") and block.get("sub_type"):
            item["sub_type"] = block["sub_type"]
        if kind in ("text", "doc_title", "paragraph_title", "page_footnote") or kind in _AUXILIARY:
            item["content"] = _escape_rule(_escape_prefix(render_spans(content)))
        elif kind == "equation":
            item["content"] = (content or "").strip()
            item["image_source"] = f"{self.image_dir}/{_image_name(self.page.index, 'equation', block['index'])}"
        elif kind in ("image", "table", "chart", "code"):
            item["content"] = self.visual_content(block)
            children = sorted(content, key=lambda c: c["index"])
            for key, suffix in (("captions", "_caption"), ("footnotes", "_footnote")):
                item[key] = [
                    {"bbox": [float(v) for v in c["bbox"]], "content": _escape_rule(render_spans(c["content"]))}
                    for c in children
                    if c["type"].endswith(suffix)
                ]
            if kind != "code":
                item["image_source"] = f"{self.image_dir}/{_image_name(self.page.index, kind, block['index'])}"
        else:
            item["content"] = self.markdown(block)
        return item

    def visual_content(self, group: dict) -> str:
        """A visual's body as structured content holds it: what was read, never its image."""
        visual = group["type"]
        body = next(c for c in group["content"] if c["type"].endswith("_body"))
        content = body.get("content")
        if visual == "code":
            if group.get("sub_type") == "algorithm":
                return _algorithm_markdown(content)
            return _fenced(content or "", "txt")
        text = (content or "").strip() if visual != "table" else content
        if not text:
            return ""
        if visual == "image":
            return format_embedded_html(text)
        if visual == "table":
            return render_table(text) or _fenced(text)
        return render_table(text) or format_embedded_html(text)


def _algorithm_text(spans: list[dict], render: Callable[[dict], str]) -> str:
    """An algorithm's spans, each rendered by ``render``, a space between two adjacent inline equations."""
    parts, previous_eq = [], False
    for span in spans:
        is_eq = span["type"] == "equation_inline"
        if previous_eq and is_eq:
            parts.append(" ")
        parts.append(render(span))
        previous_eq = is_eq
    return "".join(parts)


def _algorithm_markdown(spans: list[dict]) -> str:
    """An algorithm's spans as Markdown."""
    return _algorithm_text(spans, lambda span: render_spans([span]))


def _confidences(entry: dict) -> Iterable[tuple[Confidence | None, bool]]:
    """``(confidence, low_confidence)`` of a page-model entry and of the entries nested in it."""
    if CONFIDENCE_KEY in entry:
        yield entry[CONFIDENCE_KEY]
    content = entry.get("content")
    if isinstance(content, list):
        for child in content:
            if isinstance(child, dict):
                yield from _confidences(child)


def confidence_field(entries: list[dict]) -> dict | None:
    """The ``mf_confidence`` value of an item made from ``entries`` (see the module docstring)."""
    parts = [part for entry in entries for part in _confidences(entry)]
    combined = Confidence.combine(confidence for confidence, _ in parts)
    if combined is None:
        return None
    return {**combined.to_dict(), "low_confidence": any(low for _, low in parts)}


def _reference_item(blocks: list[dict], page_idx: int) -> dict:
    """A run of reference entries as one list item (mineru ``content_list.common.iter_page_units``, v1)."""
    boxes = [b["bbox"] for b in blocks]
    bbox = [min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)]
    return {
        "type": "list",
        "sub_type": "ref_text",
        "list_items": [render_spans(b["content"]) for b in blocks if b["content"]],
        "bbox": [int(v * 1000) for v in bbox],
        "page_idx": page_idx,
    }


def _annotations(group: dict, kind: str) -> list[str]:
    return [render_spans(c["content"]) for c in sorted(group["content"], key=lambda c: c["index"]) if c["type"] == kind]


_INDEX_ROMAN = re.compile(r"[ivxlcdm]+", re.IGNORECASE)


def strip_index_page_tail(spans: list[dict]) -> list[dict]:
    """An index entry without the page number after its last tab (digits, a roman numeral or one
    letter, at most 12 characters), its other tabs made spaces.

    Mirrors docvortex ``render._internal.common.index.strip_index_page_tail``.
    """
    text = plain_text(spans)
    if "\t" not in text:
        return spans
    cut = text.rfind("\t")
    tail = text[cut + 1 :].strip()
    if tail and len(tail) <= 12 and (tail.isdigit() or _INDEX_ROMAN.fullmatch(tail) or re.fullmatch("[A-Za-z]", tail)):
        kept, offset = [], 0
        for span in spans:
            if offset >= cut:
                break
            length = len(span["content"])
            kept.append({**span, "content": span["content"][: cut - offset]} if span["type"] == "text" else span)
            offset += length
        spans = kept
    out = [{**s, "content": s["content"].replace("\t", " ")} if s["type"] == "text" else s for s in spans]
    return [s for s in out if s["type"] != "text" or s["content"]]


_REFERENCE_NUMBER = re.compile(r"^\D{0,4}\d")  # a (Unicode) digit among the first five characters
_UNORDERED_MARKER = re.compile(r"^[ \t]*-[ \t]+")


def _needs_bullets(children: list[dict]) -> bool:
    """Whether a reference list's items get ``- `` bullets: when at most half of its non-empty items
    carry a number in their first five characters (``[1]``, ``1 Smith``, ``【1】``, ``1、``).

    Mirrors docvortex ``render._internal.common.list_items.reference_list_needs_bullets``.
    """
    visible = [plain_text(c["content"]).lstrip() for c in children]
    visible = [v for v in visible if v]
    numbered = sum(1 for v in visible if _REFERENCE_NUMBER.match(v))
    return bool(visible) and numbered * 2 <= len(visible)


def _fenced(content: str, language: str = "") -> str:
    """Content in a fence longer than its backtick runs (docvortex ``markdown.blocks._render_fenced_content``)."""
    longest = max((len(m.group(0)) for m in re.finditer(r"`+", content)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{content}{'' if content.endswith(chr(10)) else chr(10)}{fence}"


def _algorithm_html(spans: list[dict]) -> str:
    """An algorithm as preformatted HTML (docvortex ``markdown.blocks._render_algorithm_html``)."""
    body = _algorithm_text(
        spans,
        lambda span: html.escape(
            f"${span['content']}$" if span["type"] == "equation_inline" else span["content"], quote=False
        ),
    )
    if not body.strip():
        return ""
    return f'<div class="docvortex-algorithm" style="white-space: pre-wrap; font-family:monospace;">\n{body}\n</div>'


def _piece_kind(block: dict) -> str:
    if block["type"] == "list" and block.get("sub_type") == "ref_text":
        return "ref_list"
    if block["type"] == "table":
        return "table"
    return "transparent" if block["type"] in TRANSPARENT else "block"


def render_page(page: Page, image_dir: str = "images", *, confidence: bool = False) -> PageOutput:
    """Render one finished page as mineru 4.0.12 would (see the module docstring).

    Mirrors docvortex ``render._internal.markdown.renderer._render_page`` (DEFAULT mode) and mineru
    ``render._internal.content_list.v1.render_content_list`` for one page.

    Args:
        page: a parsed page (its image is not needed here; crops are only named).
        image_dir: the folder that image paths in the outputs point into.
        confidence: add the ``mf_confidence`` extension field to each content-list item and
            structured-content block.

    Returns:
        The page's Markdown (what continues within the page joined; ``MarkdownJoiner`` joins across
        pages), its content-list items, the crops they reference, its pages of the middle JSON
        (what continues within the page marked) and of the structured content, and its pieces.
    """
    renderer = _PageRenderer(page, image_dir)
    blocks = page_model(page.blocks)
    pieces = [MarkdownPiece(renderer.markdown(b), _piece_kind(b), page.index, b, renderer.markdown) for b in blocks]
    joiner = MarkdownJoiner()
    markdown = "\n\n".join([*joiner.add(pieces), *joiner.finish()])
    renderer.crops.clear()  # the content list names every crop the page has; collect them once
    items = []
    references: list[dict] = []
    for entry in [*blocks, None]:
        if entry is not None and entry["type"] == "ref_text":
            references.append(entry)
            continue
        if references:  # a run of reference entries is one list item
            items.append(_reference_item(references, page.index))
            if confidence:
                items[-1][CONFIDENCE_FIELD] = confidence_field(references)
            references = []
        if entry is not None and (item := renderer.item(entry)) is not None:
            if confidence:
                item[CONFIDENCE_FIELD] = confidence_field([entry])
            items.append(item)
    middle = {"page_idx": page.index, "blocks": middle_blocks(blocks, page.index)}
    structured_blocks = [renderer.structured(block) for block in blocks]
    if confidence:
        for item, entry in zip(structured_blocks, blocks, strict=True):
            item[CONFIDENCE_FIELD] = confidence_field([entry])
    structured = {"page_idx": page.index, "blocks": structured_blocks}
    crops = list(dict.fromkeys(renderer.crops))
    output = PageOutput(markdown, items, crops, middle, structured, pieces, image_rotations(blocks))
    mark_continuations(output)  # what continues within the page (render_page's joiner marked it)
    return output


def mark_continuations(output: PageOutput) -> None:
    """Mark the blocks of a page's middle JSON and structured content that its pieces say continue
    the one before (``MarkdownPiece.continues_prev``, set by a ``MarkdownJoiner`` that took them)
    ``"continues_prev": true``, where DocVortex places it: after a middle JSON block's other
    fields (``docvortex.schema.ListBlock`` and ``TableBlock``), before a structured-content block's
    ``content`` (``render_structured_content`` dumps the block's fields first). Marks are only
    added, so a page marked within itself (``render_page``) and then across pages (a document's
    joiner) holds both.
    """
    blocks, items = output.middle["blocks"], output.structured["blocks"]
    for position, piece in enumerate(output.pieces):
        if not piece.continues_prev or blocks[position].get("continues_prev"):
            continue
        blocks[position]["continues_prev"] = True
        fields = list(items[position].items())
        at = next(n for n, (key, _) in enumerate(fields) if key == "content")
        items[position] = dict([*fields[:at], ("continues_prev", True), *fields[at:]])


@dataclass
class _Held:
    """A reference list or table that a later block may still continue, and what follows it."""

    head: MarkdownPiece
    block: dict  # the head's block with what joined it (the pieces themselves are never changed)
    last: MarkdownPiece  # the piece last joined into ``head`` (the head itself at first)
    changed: bool = False
    after: list[MarkdownPiece] = field(default_factory=list)  # transparent pieces after the head

    def texts(self) -> list[str]:
        head = self.head.render(self.block) if self.changed else self.head.text
        return [head, *(piece.text for piece in self.after)]


class MarkdownJoiner:
    """Joins a document's Markdown block by block, page by page, as mineru 4.0.12 renders it.

    What official's middle JSON marks as continuing is joined into what it continues (docvortex
    ``postprocess.paragraphs.merge_para_text_blocks`` and ``content.table.document.merge_table``
    set the marks; ``render._internal.common.planner`` joins):

    - a reference list after another one, with only page furniture or page footnotes between, on
      the same or the next page, adds its items to the first list (whose bullets are then decided
      on all of them);
    - a table that opens a page continues the table that closed the page before when
      ``table_merge.can_merge_tables`` allows it, and is joined into it (``table_merge.merge_tables``).

    Text blocks never continue here: official decides that from OCR text lines, and with one line
    per block (its detector finds none on VLM pages, mineru-fast has none) it never joins them.

    The pieces it finds continuing are marked (``MarkdownPiece.continues_prev``; ``mark_continuations``
    writes the marks into the middle JSON), so official's renderer reading mineru-fast's middle JSON
    joins what this joins.

    Only the last such list or table (and the transparent blocks after it) is held back, so memory
    stays flat on long documents.
    """

    def __init__(self) -> None:
        self._held: _Held | None = None
        self._page = -1  # the page of the last piece seen
        self._page_started = False  # whether that page had a non-transparent piece yet

    def add(self, pieces: Iterable[MarkdownPiece]) -> list[str]:
        """Take the next pieces, in document order; return the Markdown chunks now final."""
        out: list[str] = []
        for piece in pieces:
            opens_page = piece.page_index != self._page or not self._page_started
            if piece.page_index != self._page:
                self._page, self._page_started = piece.page_index, False
            if piece.kind == "transparent":
                if self._held is None:
                    out.append(piece.text)
                else:
                    self._held.after.append(piece)
                continue
            self._page_started = True
            if self._held is not None and self._continues(self._held, piece, opens_page):
                continue
            out.extend(self._release())
            if piece.kind in ("ref_list", "table"):
                self._held = _Held(piece, piece.block, piece)
            else:
                out.append(piece.text)
        return [text.strip("\n") for text in out if text and text.strip()]

    def finish(self) -> list[str]:
        """The chunks still held back, at the end of the document."""
        return [text.strip("\n") for text in self._release() if text and text.strip()]

    def _release(self) -> list[str]:
        held, self._held = self._held, None
        return held.texts() if held is not None else []

    def _continues(self, held: _Held, piece: MarkdownPiece, opens_page: bool) -> bool:
        """Join ``piece`` into ``held`` where official's middle JSON marks it as continuing (the
        mark is recorded on the piece) and official's renderer joins it."""
        if not _marked(held.last, piece, opens_page):
            return False
        piece.continues_prev = True
        if piece.kind == "ref_list":
            held.block = {**held.block, "content": [*held.block["content"], *piece.block["content"]]}
        else:
            merged = merge_tables(held.block, piece.block)
            if merged is None:
                return False
            held.block = merged
        held.last, held.changed = piece, True
        return True


def _marked(previous: MarkdownPiece, piece: MarkdownPiece, opens_page: bool) -> bool:
    """Whether official marks ``piece`` ``continues_prev``, ``previous`` being the reference list or
    table before it with only transparent pieces between (docvortex
    ``postprocess.paragraphs.merge_para_text_blocks``: a reference list after one on the same or
    the previous page; ``content.table.document.merge_table``: a table opening the page after the
    one ``previous`` closes, when ``table_merge.can_merge_tables`` allows it)."""
    if piece.kind != previous.kind:
        return False
    if piece.kind == "ref_list":
        return piece.page_index - previous.page_index in (0, 1)
    return opens_page and piece.page_index == previous.page_index + 1 and can_merge_tables(piece.block, previous.block)


def render_pages(pages: Iterable[Page], image_dir: str = "images") -> Iterator[PageOutput]:
    """``render_page`` of a document's pages in order, their middle JSON and structured content
    marked ``continues_prev`` where what continues across pages is, as official marks it (a
    ``MarkdownJoiner`` takes their pieces)."""
    joiner = MarkdownJoiner()
    for page in pages:
        output = render_page(page, image_dir)
        joiner.add(output.pieces)
        mark_continuations(output)
        yield output


def render_markdown(pages: Iterable[Page], image_dir: str = "images") -> str:
    """A document's Markdown from its pages in order (``render_page`` + ``MarkdownJoiner``).

    Mirrors docvortex ``render._internal.markdown.renderer.render_markdown`` (DEFAULT mode).
    """
    joiner = MarkdownJoiner()
    chunks = [chunk for page in pages for chunk in joiner.add(render_page(page, image_dir).pieces)]
    return "\n\n".join([*chunks, *joiner.finish()])


def _write_json_array(out: IO[str], items: Iterable[object], indent: int, level: int = 0) -> None:
    """Write ``items`` as ``json.dumps(list(items), indent=indent, ensure_ascii=False)`` would at
    nesting ``level``, without holding the list."""
    out.write("[")
    first = True
    for item in items:
        out.write("\n" if first else ",\n")
        out.write(textwrap.indent(json.dumps(item, ensure_ascii=False, indent=indent), " " * indent * (level + 1)))
        first = False
    out.write("]" if first else "\n" + " " * indent * level + "]")


_FILES = ("{}.md", "{}_content_list.json", "{}.json")  # the 2.x layout's final files, by stem
LAYOUTS = ("mineru4", "2.x")
"""Output layouts of a ``DocumentWriter``: MinerU 4's result bundle (the default) or MinerU 2.x's."""
MARKDOWN, MIDDLE_JSON, STRUCTURED = "markdown.md", "middle_json.json", "structured_content.json"
MODEL_OUTPUT = "model_output.json"
BUNDLE_FILES = (MARKDOWN, MIDDLE_JSON, STRUCTURED, MODEL_OUTPUT)
"""The files of MinerU 4's result bundle (mineru 4.0.12 ``ParseResult.save``) that mineru-fast writes."""
PART = ".part"  # suffix of a final file while it is written; renamed into place by close
_MIDDLE_PAGES = MIDDLE_JSON + ".pages"  # the middle JSON's pages array while the document runs
_MODEL_PAGES = MODEL_OUTPUT + ".pages"  # model_output.json's
INTERRUPTED = "interrupted"  # code of the error a writer closed by an exception records


def _remove_written(out_dir: Path) -> None:
    """Remove the crops and overlays a writer names in ``images/`` and ``layout/``, and those
    folders once empty."""
    for folder, written in _WRITTEN_IN.items():
        path = out_dir / folder
        if not path.is_dir():
            continue
        for entry in path.iterdir():
            if written.fullmatch(entry.name) and entry.is_file():
                entry.unlink()
        if not any(path.iterdir()):
            path.rmdir()


def remove_outputs(out_dir: Path, name: str) -> None:
    """Remove what a 2.x-layout ``DocumentWriter`` wrote for document ``name`` into ``out_dir``
    before: its files (``<name>.md``, ``<name>_content_list.json``, ``<name>.json``, their
    ``.part`` files and ``<name>.pages.jsonl``), the crops and overlays it names in ``images/``
    and ``layout/``, and those folders once empty.
    Any other file stays, and so do ``images/`` and ``layout/`` when the folder also holds another
    document's content list (crop names do not say which document wrote them).
    """
    for file_name in _FILES:
        (out_dir / file_name.format(name)).unlink(missing_ok=True)
        (out_dir / (file_name.format(name) + PART)).unlink(missing_ok=True)
    (out_dir / f"{name}.pages.jsonl").unlink(missing_ok=True)
    if any(out_dir.glob("*_content_list.json")):  # another document's outputs share the folder
        return
    _remove_written(out_dir)


def remove_bundle(out_dir: Path) -> None:
    """Remove a MinerU 4 bundle a ``DocumentWriter`` wrote into ``out_dir`` before: the
    ``BUNDLE_FILES``, their ``.part`` files, and its crops and overlays (``images/``, ``layout/``,
    removed once empty). Any other file stays."""
    for file_name in (*BUNDLE_FILES, _MIDDLE_PAGES, _MODEL_PAGES):
        (out_dir / file_name).unlink(missing_ok=True)
        (out_dir / (file_name + PART)).unlink(missing_ok=True)
    _remove_written(out_dir)


def write_page_images(
    out: Path, page: Page, crops: list[tuple[str, tuple[float, float, float, float]]], *, overlay: bool = True
) -> None:
    """Write a page's crops as ``out/images/<name>`` (JPEG, quality 90) and, with ``overlay`` and
    the page image, its layout overlay as ``out/layout/page_NNNN.png`` (1-based).

    Args:
        out: the document's output directory.
        page: the page; with its image the crops are cut from it, without it ``page.crops`` are written.
        crops: ``PageOutput.crops`` of the page (``render_page``).
        overlay: also write the overlay (needs the page image).
    """
    images = page.crops if page.image is None else cut_crops(page, crops)
    for file_name, crop in images.items():
        (out / "images").mkdir(exist_ok=True)
        crop.save(out / "images" / file_name, quality=90)
    if page.image is not None and overlay:
        (out / "layout").mkdir(exist_ok=True)
        layout_overlay(page).save(out / "layout" / _overlay_name(page.index))


def envelope_for(
    metadata: dict[str, Any] | None,
    head: dict[str, Any],
    pages: list[dict[str, Any]],
    modes: set[str | None],
    rotations: dict[int, dict[str, int]] | None = None,
) -> Envelope:
    """The middle JSON's document fields (``middle.Envelope``) of a result.

    Args:
        metadata: the result's metadata block (its ``input`` gives the page count and the pages
            parsed, its ``tier`` the tier); None: the pages written are the whole document.
        head: mineru-fast's record of the result (``metadata.head_dict``).
        pages: per page ``{"page_idx", "status", "errors", "warnings"}``, added to the record.
        modes: the pages' ``ocr_mode`` values (``"txt"`` for all: MinerU 4's parse mode ``txt``).
        rotations: per page index, its crops turned upright (``PageOutput.rotations``).

    ``is_full_document`` holds only when every page of the source was selected and written, and
    the writing was not cut short (an ``INTERRUPTED`` error in ``head``).
    """
    metadata = metadata or {}
    source = metadata.get("input") or {}
    count = source.get("page_count") or len(pages)
    parsed = source.get("pages")
    every_page = list(range(count))
    interrupted = any(error.get("code") == INTERRUPTED for error in head.get("errors") or [])
    written = [page["page_idx"] for page in pages]
    full = not interrupted and written == every_page and (parsed is None or list(parsed) == every_page)
    parse_mode = "txt" if modes == {"txt"} else "ocr"
    pdf = source.get("format", "pdf") == "pdf"
    geometry = source.get("page_geometry")  # absent from results written before schema 1.2
    return Envelope(
        count, full, metadata.get("tier"), parse_mode, {**head, "pages": pages}, pdf=pdf,
        properties=dict(source.get("properties") or {}), geometry=None if geometry is None else list(geometry),
        rotations=dict(rotations or {}),
    )  # fmt: skip


def page_summary(page: Page) -> dict[str, Any]:
    """A page's entry in mineru-fast's record of a bundle: index, status and problems."""
    problems = {"errors": [e.to_dict() for e in page.errors], "warnings": list(page.warnings)}
    return {"page_idx": page.index, "status": page.status, **problems}


class DocumentWriter:
    """Writes a document's outputs page by page, so memory stays flat however long it is.

    Layout ``"mineru4"`` (default): MinerU 4's result bundle in ``out_dir``, the files and names
    mineru 4.0.12's ``ParseResult.save`` writes: ``markdown.md``, ``middle_json.json`` (DocVortex's
    middle JSON, ``middle``; mineru-fast's own record of the parse is its
    ``extensions["mineru_fast"]``), ``structured_content.json`` and ``images/`` (crops, named as
    ``middle.image_name``). Layout ``"2.x"``: MinerU 2.x's, ``<stem>.md``,
    ``<stem>_content_list.json``, mineru-fast's ``<stem>.json`` (``Document.to_dict``), ``images/``
    and ``layout/`` overlays.

    Each ``add_page`` renders the page, writes its crops (and overlay) at once, appends its parts
    to the open output files (its Markdown through a ``MarkdownJoiner``: all but a reference list or
    table the next page may continue; its middle JSON page with what continues marked), then
    (``release``) drops the page's images. While a long document runs, the pages already done are
    on disk in ``.part`` files; ``close`` finishes them (the Markdown held back, the record and the
    middle JSON's document fields are known only then; the pages are copied, never held) and only
    then renames them into place: a final file is always whole.

    Used as a context manager, a ``with`` block left by an exception (the loop feeding the pages
    raised) still closes the files, but records the document as a ``failure`` with an
    ``"interrupted"`` error naming the exception and the pages written: results never claim more
    than they hold. An ``OSError`` while writing (no permission, a full disk, the folder is a file)
    removes everything written for the document and is raised as ``errors.OutputError``.

    A folder written before (a re-parse) holds only the new outputs afterwards: the earlier run's
    files of this document are removed first (``remove_bundle`` / ``remove_outputs``), any other
    file is kept.

    Args:
        out_dir: output directory (created).
        name: the document's name (the file stem of the 2.x layout).
        layout: ``"mineru4"`` or ``"2.x"`` (``LAYOUTS``).
        overlays: also write ``layout/page_NNNN.png`` (needs the page image); None = only in the
            2.x layout (MinerU 4's bundle has none).
        release: drop each page's image and crops once written (a caller keeping the pages, as
            ``Document.save`` does, passes False).
        metadata: the result's metadata block (``DocumentParser.result_metadata``), written into
            ``<stem>.json`` or the middle JSON's ``extensions["mineru_fast"]``.
        confidence: add the ``mf_confidence`` extension field to the content-list items (2.x) or
            the structured-content blocks (mineru4).

    Raises:
        ValueError: an unknown ``layout``.
        OutputError: the folder cannot be created or written (the path is a file, no permission).
    """

    def __init__(
        self,
        out_dir: str | Path,
        name: str,
        *,
        layout: str = "mineru4",
        overlays: bool | None = None,
        release: bool = True,
        metadata: dict[str, Any] | None = None,
        confidence: bool = False,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.out = Path(out_dir)
        self.name, self.layout, self.release = name, layout, release
        self.overlays = layout == "2.x" if overlays is None else overlays
        self.metadata, self.confidence = metadata, confidence
        self._handles: list[IO[str]] = []
        self._md_started = self._cl_started = False
        self._joiner = MarkdownJoiner()  # what may still continue on the next page is held there
        self.statuses: list[str] = []
        self.timings: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._summaries: list[dict[str, Any]] = []  # mineru4: each page's status and problems
        self._modes: set[str | None] = set()
        self._rotations: dict[int, dict[str, int]] = {}  # mineru4: crops turned upright, per page
        self.document_status: str | None = None  # set by close
        with self._output_errors():
            self.out.mkdir(parents=True, exist_ok=True)
            if layout == "2.x":
                remove_outputs(self.out, name)
                self._md = self._open(self._part("{}.md"), "w")
                self._cl = self._open(self._part("{}_content_list.json"), "w")
                self._pages_path = self.out / f"{name}.pages.jsonl"
            else:
                remove_bundle(self.out)
                self._md = self._open(self._part(MARKDOWN), "w")
                self._cl = self._open(self._part(STRUCTURED), "w")
                self._pages_path = self.out / (_MIDDLE_PAGES + PART)
                self._model = self._open(self.out / (_MODEL_PAGES + PART), "w")
            self._pages = self._open(self._pages_path, "w")

    def _part(self, file_name: str) -> Path:
        return self.out / (file_name.format(self.name) + PART)

    def _final_files(self) -> list[str]:
        if self.layout == "2.x":
            return [file_name.format(self.name) for file_name in _FILES]
        return list(BUNDLE_FILES)

    def _open(self, path: Path, mode: str) -> IO[str]:
        handle = path.open(mode, encoding="utf-8")
        self._handles.append(handle)
        return handle

    @contextmanager
    def _output_errors(self) -> Iterator[None]:
        """Turn an ``OSError`` of the block into ``OutputError`` after ``abort``."""
        try:
            yield
        except OSError as exc:
            if isinstance(exc, OutputError):
                raise
            self.abort()
            reason = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
            raise OutputError(f"cannot write the outputs of {self.name} in {self.out}: {reason}") from exc

    def abort(self) -> None:
        """Close the files and remove everything written for the document (``remove_bundle`` /
        ``remove_outputs``); errors while removing are ignored (the folder may be unwritable:
        nothing was written there)."""
        for handle in self._handles:
            with suppress(OSError):
                handle.close()
        self._handles.clear()
        with suppress(OSError):
            if self.layout == "2.x":
                remove_outputs(self.out, self.name)
            else:
                remove_bundle(self.out)

    def add_page(self, page: Page) -> PageOutput:
        """Render and write one finished page; returns what it contributed. A page without its
        image (``release``d elsewhere, e.g. by a batch actor that wrote its images itself with
        ``write_page_images``) adds its text and record, and whatever ``page.crops`` holds.

        Raises:
            OutputError: a file could not be written (nothing of the document is left).
        """
        output = render_page(page, confidence=self.confidence)
        with self._output_errors():
            self._write_page(page, output)
        if self.release:
            page.image, page.crops = None, {}
        return output

    def _append_item(self, handle: IO[str], item: object, started: bool, opening: str, level: int) -> None:
        """One element of a JSON array written as ``json.dumps(..., indent=2)`` writes it at
        nesting ``level`` (``opening`` starts the array)."""
        text = textwrap.indent(json.dumps(item, ensure_ascii=False, indent=2), "  " * level)
        handle.write((",\n" if started else opening) + text)

    def _write_page(self, page: Page, output: PageOutput) -> None:
        self._write_markdown(self._joiner.add(output.pieces))
        if self.layout == "2.x":
            for item in output.content_list:
                self._append_item(self._cl, item, self._cl_started, "[\n", 1)
                self._cl_started = True
        else:
            mark_continuations(output)  # what continues from the page before (self._joiner marked it)
            self._append_item(self._cl, output.structured, self._cl_started, '{\n  "pages": [\n', 2)
            self._append_item(self._pages, page_entry(output.middle), self._cl_started, "\n", 2)
            self._append_item(self._model, model_page(page), self._cl_started, "\n", 2)
            self._model.flush()
            self._cl_started = True
        self._md.flush()
        self._cl.flush()
        write_page_images(self.out, page, output.crops, overlay=self.overlays)
        if self.layout == "2.x":
            self._pages.write(json.dumps(page.to_dict(), ensure_ascii=False) + "\n")
        else:
            self._summaries.append(page_summary(page))
            self._modes.add(page.ocr_mode)
            self._rotations[page.index] = output.rotations
        self._pages.flush()
        self.statuses.append(page.status)
        for key, value in page.timings.items():
            self.timings[key] = self.timings.get(key, 0.0) + value
        for key, count in page.counts.items():
            self.counts[key] = self.counts.get(key, 0) + count

    def _write_markdown(self, chunks: list[str]) -> None:
        for chunk in chunks:
            self._md.write(("\n\n" if self._md_started else "") + chunk)
            self._md_started = True

    def __enter__(self) -> DocumentWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if not self._handles:  # closed, or aborted by an output error
            return
        if exc is None:
            self.close()
            return
        message = f"writing stopped after {len(self.statuses)} page(s): {type(exc).__name__}: {exc}"
        with suppress(OutputError):  # the exception of the block is the one that propagates
            self.close([ParseError(INTERRUPTED, message)])

    def envelope(self, head: dict[str, Any]) -> Envelope:
        """The middle JSON's document fields for the pages written and the record ``head``."""
        return envelope_for(self.metadata, head, self._summaries, self._modes, self._rotations)

    def close(self, errors: list[ParseError] | None = None, wall_s: float | None = None) -> Path:
        """Finish the files: the 2.x layout's ``<stem>.json`` (``Document.to_dict``'s layout),
        the bundle's middle JSON and structured content with their document fields.

        Args:
            errors: document-level errors to record.
            wall_s: wall-clock seconds of the parse, recorded as ``timings["wall"]``.

        Returns:
            The output directory.

        Raises:
            OutputError: a file could not be written (nothing of the document is left).
        """
        errors = list(errors or [])
        timings = dict(self.timings)
        if wall_s is not None:
            timings["wall"] = wall_s
        status = status_of(errors, self.statuses)
        head = head_dict(self.name, status, self.metadata, errors, timings, self.counts)
        with self._output_errors():
            self._write_markdown(self._joiner.finish())
            if self.layout == "2.x":
                self._cl.write("\n]" if self._cl_started else "[]")
            else:
                envelope = self.envelope(head)
                self._cl.write(("\n  ]" if self._cl_started else '{\n  "pages": []') + envelope.structured_tail())
            for handle in (self._md, self._cl, self._pages):
                handle.close()
            if self.layout == "2.x":
                with self._open(self._part("{}.json"), "w") as full, self._pages_path.open() as lines:
                    full.write(json.dumps(head, ensure_ascii=False, indent=2)[:-2] + ',\n  "pages": ')
                    _write_json_array(full, (json.loads(line) for line in lines), indent=2, level=1)
                    full.write("\n}")
            else:
                self._model.close()
                written = [summary["page_idx"] for summary in self._summaries]
                for target, pages_path, (before, after) in (
                    (MIDDLE_JSON, self._pages_path, envelope.middle_parts()),
                    (MODEL_OUTPUT, self.out / (_MODEL_PAGES + PART), envelope.model_parts(written)),
                ):
                    with self._open(self._part(target), "w") as whole, pages_path.open(encoding="utf-8") as pages:
                        whole.write(before + "[")
                        shutil.copyfileobj(pages, whole)
                        whole.write(("\n  ]" if self._cl_started else "]") + after)
                    pages_path.unlink()
            self._handles.clear()
            self._pages_path.unlink(missing_ok=True)
            for file_name in self._final_files():
                (self.out / (file_name + PART)).replace(self.out / file_name)
        self.document_status = status
        return self.out
