"""A page's blocks -> MinerU 4's page model (its "middle JSON" page), pure Python.

Facts follow mineru 4.0.12's advanced tier (``backend/analysis/pdf``: caption/footnote types made
generic, ``title`` split, formula numbers merged into equations, empty text dropped, inline math to
spans, full-width letters / digits / PDF symbols made half-width) and its document model
(docvortex: visual bodies grouped with their captions and footnotes by reading order and geometry,
text inside a ``list`` box made list items, ``index`` split into lines). Everything is per page:
MinerU 4's cross-page rules (paragraph continuation, table continuation) are not applied (see the
README, "Output format").

A page model is a list of dicts in reading order; text-like contents are span lists
``[{"type": "text" | "equation_inline", "content": str}]``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from copy import deepcopy
from typing import Any

from bs4 import BeautifulSoup, NavigableString, PageElement, Tag

from mineru_fast.results.page import Block

__all__ = ["page_model", "TITLE_LEVEL_PARAGRAPH"]

TITLE_LEVEL_PARAGRAPH = 2  # mineru 4: a 2509 "title" is a paragraph_title of level 2 without its layout model

_CAPTION_TYPES = {"table_caption": "caption", "image_caption": "caption", "code_caption": "caption"}
_FOOTNOTE_TYPES = {"table_footnote": "footnote", "image_footnote": "footnote"}
# Block types whose empty content drops the block (mineru: LINE_METADATA_BLOCK_TYPES).
_DROP_WHEN_EMPTY = {"text", "ref_text", "doc_title", "paragraph_title", "caption", "footnote"}
NATURAL_LANGUAGE = {
    "text", "doc_title", "paragraph_title", "aside_text", "header", "footer", "page_number",
    "page_footnote", "ref_text", "list", "index", "caption", "footnote",
}  # fmt: skip
_BODY_TYPES = {"image": "image_body", "table": "table_body", "chart": "chart_body"}
VISUAL_MAIN = {"image_body": "image", "table_body": "table", "chart_body": "chart", "code_body": "code"}
_CHILD_KIND = {
    "caption": (None, "caption"),
    "footnote": (None, "footnote"),
    "image_caption": ("image", "caption"),
    "image_footnote": ("image", "footnote"),
    "table_caption": ("table", "caption"),
    "table_footnote": ("table", "footnote"),
    "chart_caption": ("chart", "caption"),
    "chart_footnote": ("chart", "footnote"),
    "code_caption": ("code", "caption"),
    "code_footnote": ("code", "footnote"),
}
# Blocks that never break a visual or caption relation (page furniture and page footnotes).
TRANSPARENT = {"header", "footer", "page_number", "aside_text", "page_footnote"}
_REPLACED = {
    "text", "ref_text", "list", "index", "caption", "footnote", "image_body", "table_body",
    "chart_body", "code_body", *(k for k in _CHILD_KIND if "_" in k),
}  # fmt: skip
_CONTINUATION_END = [
    "(续)",
    "(续表)",
    "(续上表)",
    "(continued)",
    "(cont.)",
    "(cont’d)",
    "(…continued)",
    "continued",
    "续表",
]


# ---------------------------------------------------------------- text helpers


def full_to_half(text: str, *, punctuation: bool) -> str:
    """Full-width ASCII forms (U+FF01..FF5E) to ASCII: letters and digits only, or all of them.

    Mirrors docvortex ``foundation._text.full_to_half_exclude_marks`` / ``full_to_half``.
    """
    out = []
    for char in text:
        code = ord(char)
        alnum = 0xFF21 <= code <= 0xFF3A or 0xFF41 <= code <= 0xFF5A or 0xFF10 <= code <= 0xFF19
        out.append(chr(code - 0xFEE0) if alnum or (punctuation and 0xFF01 <= code <= 0xFF5E) else char)
    return "".join(out)


_FULLWIDTH = re.compile("[Ａ-Ｚａ-ｚ０-９：．／＼－＿％＋＝＠＃＆＊]")
_SYMBOLS = str.maketrans(dict(zip("：．／＼－＿％＋＝＠＃＆＊", ":./\\-_%+=@#&*", strict=True)))
_FORMULA_OPENING = re.compile(r"\\[\(\[]")


def normalize_text(content: str) -> str:
    """Half-width letters, digits and a whitelist of symbols outside ``\\(..\\)`` / ``\\[..\\]``.

    Mirrors docvortex ``content.normalization._normalize_text``.
    """
    if not _FULLWIDTH.search(content):
        return content
    parts, cursor = [], 0
    while match := _FORMULA_OPENING.search(content, cursor):
        parts.append(full_to_half(content[cursor : match.start()], punctuation=False).translate(_SYMBOLS))
        closing = r"\)" if match.group() == r"\(" else r"\]"
        end = content.find(closing, match.end())
        if end < 0:
            parts.append(content[match.start() :])
            return "".join(parts)
        cursor = end + len(closing)
        parts.append(content[match.start() : cursor])
    parts.append(full_to_half(content[cursor:], punctuation=False).translate(_SYMBOLS))
    return "".join(parts)


def to_spans(content: str) -> list[dict]:
    """Natural-language text -> spans: ``\\(..\\)`` becomes an inline equation (an empty one is
    dropped); text is made half-width and otherwise kept as is (surrounding whitespace too).

    Mirrors mineru ``backend.analysis.pdf.normalization._natural_language_spans`` (before its strip)
    and docvortex ``content.normalization._normalize_spans``.
    """
    spans: list[dict] = []

    def add_text(text: str) -> None:
        if not text:
            return
        if spans and spans[-1]["type"] == "text":
            spans[-1]["content"] += text
        else:
            spans.append({"type": "text", "content": text})

    cursor = 0
    for match in re.finditer(r"\\\((.*?)\\\)", content, re.DOTALL):
        add_text(content[cursor : match.start()])
        if latex := match.group(1).strip():
            spans.append({"type": "equation_inline", "content": latex})
        cursor = match.end()
    add_text(content[cursor:])
    _normalize_span_text(spans)
    return spans


def strip_spans(spans: list[dict]) -> list[dict]:
    """Strip leading / trailing whitespace of the visible text (equations count as visible).

    Mirrors docvortex ``content.spans.strip_span_dicts``.
    """
    spans = [dict(s) for s in spans]
    if spans and spans[0]["type"] == "text":
        spans[0]["content"] = spans[0]["content"].lstrip()
    if spans and spans[-1]["type"] == "text":
        spans[-1]["content"] = spans[-1]["content"].rstrip()
    return [s for s in spans if s["content"]]


def _normalize_span_text(spans: list[dict]) -> None:
    """``normalize_text`` over the text spans; equations act as barriers, lengths are preserved."""
    parts = [s["content"] if s["type"] == "text" else "\0" for s in spans]
    source = "".join(parts)
    normalized = normalize_text(source)
    if normalized == source:
        return
    offset = 0
    for span, part in zip(spans, parts, strict=True):
        if span["type"] == "text":
            span["content"] = normalized[offset : offset + len(part)]
        offset += len(part)


def plain_text(spans: list[dict] | str | None) -> str:
    """Visible text of spans (or the string itself)."""
    if isinstance(spans, list):
        return "".join(s["content"] for s in spans)
    return spans or ""


def _merge_spans(spans: list[dict]) -> list[dict]:
    out: list[dict] = []
    for span in spans:
        if out and out[-1]["type"] == "text" and span["type"] == "text":
            out[-1] = {"type": "text", "content": out[-1]["content"] + span["content"]}
        elif span["type"] != "text" or span["content"]:
            out.append(dict(span))
    return out


def clean_isolated_formula(content: str) -> str:
    """An equation's LaTeX without one surrounding ``\\[ .. \\]``, stripped.

    Mirrors docvortex ``foundation._text.clean_isolated_formula``.
    """
    if content.startswith("\\["):
        content = content[2:]
    if content.endswith("\\]"):
        content = content[:-2]
    return content.strip()


def tagged_formula(formula: str, tag: str) -> str | None:
    """``formula\\tag{n}`` from a formula and its number text such as ``(3.1)``; None if either is empty."""
    formula = clean_isolated_formula(formula or "")
    tag = full_to_half((tag or "").strip(), punctuation=True)
    if tag.startswith(("(", "﹙")):
        tag = tag[1:].strip()
    if tag.endswith((")", "﹚")):
        tag = tag[:-1].strip()
    return f"{formula}\\tag{{{tag}}}" if formula and tag else None


def code_content_clean(content: str | None) -> str:
    """Code without a surrounding Markdown fence (docvortex ``postprocess.content.code_content_clean``)."""
    if not content:
        return ""
    lines = content.splitlines()
    start = 1 if lines and lines[0].startswith("```") else 0
    end = len(lines)
    if lines and end > start and lines[end - 1].strip() == "```":
        end -= 1
    return "\n".join(lines[start:end]).strip() if start < end else ""


def is_table_continuation_text(text: str) -> bool:
    """Text saying "table continued" (``续表``, ``(continued)``, ...).

    Mirrors docvortex ``content.table.rules.is_table_continuation_text``.
    """
    text = full_to_half((text or "").strip(), punctuation=True).lower()
    if not text:
        return False
    for marker in _CONTINUATION_END:
        if text.endswith(marker):
            start = len(text) - len(marker)
            if marker != "continued" or start == 0 or not text[start - 1].isalpha():
                return True
    return "(continued)" in text


# ---------------------------------------------------------------- analysis steps (mineru)


CONFIDENCE_KEY = "_confidence"
"""Key of the page model entries made from a block: ``(Block.confidence, Block.low_confidence)``,
for the writer's optional ``mf_confidence`` field (MinerU has no such key)."""

ANGLE_KEY = "_angle"
"""Key of the page model entries made from a block: ``Block.angle``, kept through the merges as
mineru keeps a block's angle, for ``middle.image_rotations`` (MinerU has no such key)."""


def _analysis_blocks(blocks: list[Block]) -> list[dict]:
    """mineru's xhigh steps from the VLM blocks to its normalized model list of one page.

    Mirrors mineru ``backend.analysis.pdf.window._finish_pdf_window`` (``layout.
    _normalize_xhigh_vlm_blocks``, ``normalization._apply_layout_title_split`` without a layout
    model, formula numbers, ``docvortex.document.pdf.visuals._collapse_image_blocks``) and
    ``normalization._normalize_pdf_model_list``.
    """
    model: list[dict] = []
    for block in blocks:
        kind = _CAPTION_TYPES.get(block.type) or _FOOTNOTE_TYPES.get(block.type) or block.type
        item: dict[str, Any] = {"type": kind, "bbox": list(block.bbox), "content": block.content}
        item[CONFIDENCE_KEY] = (block.confidence, block.low_confidence)
        item[ANGLE_KEY] = block.angle
        if block.sub_type:
            item["sub_type"] = block.sub_type
        if kind == "title":
            item["type"], item["level"] = "paragraph_title", TITLE_LEVEL_PARAGRAPH
        model.append(item)
    model = collapse_image_blocks(_merge_formula_numbers(model))
    out = []
    for item in model:
        kind, content = item["type"], item.get("content")
        if kind == "phonetic":
            item["type"] = kind = "text"
        elif kind == "equation" and isinstance(content, str):
            item["content"] = clean_isolated_formula(content)
        if isinstance(content, str):
            if kind in NATURAL_LANGUAGE:
                item["content"] = to_spans(content)
            elif kind == "algorithm":
                item["content"] = to_spans_raw(content, strip=False)
            elif kind == "code":
                spans = to_spans_raw(content)
                if any(s["type"] == "equation_inline" for s in spans):
                    item["type"], item["content"] = "algorithm", spans
            elif kind == "table":
                item["content"] = _normalize_table(content)
        if item["type"] in _DROP_WHEN_EMPTY and not plain_text(item.get("content")).strip():
            continue
        out.append(item)
    return out


def to_spans_raw(content: str, *, strip: bool = True) -> list[dict]:
    """Spans without half-width normalization (code keeps its characters), optionally stripped."""
    spans: list[dict] = []
    cursor = 0
    for match in re.finditer(r"\\\((.*?)\\\)", content, re.DOTALL):
        if content[cursor : match.start()]:
            spans.append({"type": "text", "content": content[cursor : match.start()]})
        if latex := match.group(1).strip():
            spans.append({"type": "equation_inline", "content": latex})
        cursor = match.end()
    if content[cursor:]:
        spans.append({"type": "text", "content": content[cursor:]})
    spans = _merge_spans(spans)
    return strip_spans(spans) if strip else spans


IMAGE_BLOCK_CONTAINMENT = 0.8  # docvortex 0.6.4 document/pdf/constants.py IMAGE_BLOCK_CONTAINMENT_THRESHOLD


def collapse_image_blocks(model: list[dict]) -> list[dict]:
    """Each ``image_block`` container becomes one ``image`` with the container's box, and every other
    block at least 80 % of whose area lies inside a container is dropped (inner images, labels,
    captions alike), as docvortex's ``document.pdf.visuals._collapse_image_blocks`` does before
    mineru 4.0.12 names its crops; boxes are compared as the 0..1 floats the model gave.

    Args:
        model: a page's model list (dicts with ``type`` and ``bbox``), in reading order.

    Returns:
        The list without the contained blocks (the containers renamed in place).
    """
    containers = [item for item in model if item["type"] == "image_block"]
    if not containers:
        return model
    kept = []
    for item in model:
        if item["type"] == "image_block":
            item["type"] = "image"
            kept.append(item)
        elif not any(
            _inside_ratio(tuple(item["bbox"]), tuple(c["bbox"])) >= IMAGE_BLOCK_CONTAINMENT for c in containers
        ):
            kept.append(item)
    return kept


def _merge_formula_numbers(model: list[dict]) -> list[dict]:
    """A ``formula_number`` joins the equation before it (else the one after it, unless that one has
    its own number next) as ``\\tag{..}`` with the union box; an orphan number becomes text.

    Mirrors mineru ``backend.analysis.pdf.formulas.optimize_hybrid_formula_number_blocks``.
    """
    out: list[dict] = []
    for i, item in enumerate(model):
        if item["type"] != "formula_number":
            out.append(item)
            continue
        prev_item = model[i - 1] if i > 0 else None
        next_item = model[i + 1] if i + 1 < len(model) else None
        after = model[i + 2] if i + 2 < len(model) else None
        if prev_item is not None and prev_item["type"] == "equation":
            _join_number(prev_item, item)
        elif (
            next_item is not None
            and next_item["type"] == "equation"
            and (after is None or after["type"] != "formula_number")
        ):
            _join_number(next_item, item)
        else:
            out.append({**item, "type": "text"})
    return out


def _join_number(equation: dict, number: dict) -> None:
    a, b = equation["bbox"], number["bbox"]
    equation["bbox"] = [min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])]
    if tagged := tagged_formula(str(equation.get("content") or ""), str(number.get("content") or "")):
        equation["content"] = tagged


_OPAQUE_TAGS = frozenset(
    {
        "eq",
        "math",
        "pre",
        "code",
        "script",
        "style",
        "svg",
        "template",
        "textarea",
        "object",
        "embed",
        "canvas",
        "iframe",
    }
)  # docvortex 0.6.4 content/normalization.py _OPAQUE_HTML_TAGS
_OPAQUE_BLOCK_TYPES = frozenset({"equation", "code", "code_body", "algorithm", "algorithm_body"})
_CELL_BARRIERS = frozenset({"table", "br", "hr", "img"})


def _is_opaque(element: Tag) -> bool:
    """Formulas, code and other non-text carriers whose text is never normalized (docvortex
    ``content.normalization._is_opaque_html_node``)."""
    return (
        element.name.split(":")[-1].lower() in _OPAQUE_TAGS
        or element.get("data-block-type") in _OPAQUE_BLOCK_TYPES
        or element.has_attr("data-docvortex-latex")
        or element.has_attr("data-formula-display")
        or "docvortex-math" in element.get_attribute_list("class")
    )


def _cell_parts(node: PageElement) -> Iterator[tuple[NavigableString | None, str]]:
    """A cell's visible text nodes (plain character data: not comments, CDATA, script or ruby
    text); opaque elements, nested tables and breaks are barriers."""
    if type(node) is NavigableString:
        yield node, str(node)
    elif isinstance(node, Tag):
        if _is_opaque(node) or node.name in _CELL_BARRIERS:
            yield None, "\0"
        else:
            for child in node.children:
                yield from _cell_parts(child)


def _normalize_table(markup: str) -> str:
    """Half-width letters, digits and symbols in the visible text of table cells; when any text
    changes the whole table is written anew (``str(BeautifulSoup(markup, "html.parser"))``), else
    the markup is kept as is.

    Mirrors docvortex ``content.normalization._normalize_table`` (mineru 4.0.12's PDF text
    normalization): cells inside opaque elements are skipped; text nodes of one cell are
    normalized together (``normalize_text``, formulas kept) and cut back to their lengths.
    """
    if not _FULLWIDTH.search(markup) and "&#" not in markup:
        return markup
    soup = BeautifulSoup(markup, "html.parser")
    changed = False
    for cell in soup.find_all(["td", "th"]):
        if any(_is_opaque(element) for element in (cell, *cell.parents)):
            continue
        entries = [part for child in cell.children for part in _cell_parts(child)]
        source = "".join(text for _, text in entries)
        normalized = normalize_text(source)
        if normalized == source:
            continue
        offset = 0
        for node, text in entries:
            replacement = normalized[offset : offset + len(text)]
            offset += len(text)
            if node is not None and replacement != text:
                node.replace_with(NavigableString(replacement))
                changed = True
    return str(soup) if changed else markup


# ---------------------------------------------------------------- document model steps (docvortex)


def page_model(blocks: list[Block]) -> list[dict]:
    """The MinerU 4 page model of a page's final blocks (see the module docstring).

    Mirrors docvortex ``postprocess.page_blocks.process_page_blocks`` (on the output of
    ``_analysis_blocks``).

    Returns:
        Top-level blocks in reading order. Each has ``type``, ``index`` (its position in mineru's
        model list, which names its image file), ``bbox`` (0..1 floats) and ``content``: spans for
        text-like blocks, a string for equations, and for ``image`` / ``table`` / ``chart`` /
        ``code`` / ``list`` / ``index`` the list of child blocks in reading order.
    """
    model = _analysis_blocks(blocks)
    for index, item in enumerate(model):
        item["index"] = index
        kind, content = item["type"], item.get("content")
        if kind in _BODY_TYPES:
            item["type"] = _BODY_TYPES[kind]
            if kind != "table" and content is None:
                item["content"] = ""
        elif kind == "code":
            item.update(type="code_body", sub_type="code", content=code_content_clean(content))
        elif kind == "algorithm":
            item.update(type="code_body", sub_type="algorithm")
        elif kind == "equation":
            item["content"] = clean_isolated_formula(content or "")
        elif kind == "paragraph_title":
            item["level"] = min(max(item.get("level") or 2, 2), 6)
            item["content"] = _collapse_newlines(item["content"])
        elif kind == "doc_title":
            item["level"] = 1
            item["content"] = _collapse_newlines(item["content"])
        if item["type"] in NATURAL_LANGUAGE - {"list"} and not isinstance(item.get("content"), list):
            item["content"] = _merge_spans(item.get("content") or [])
    _caption_fallbacks(model)
    lists, texts, refs, indexes = _lists_and_indexes(model)
    groups, unmatched = _regroup_visuals(model)
    for item in unmatched:
        item["type"] = "text"
        texts.append(item)
    result = [b for b in model if b["type"] not in _REPLACED]
    result.extend(lists + texts + refs + indexes + groups)
    result.sort(key=lambda b: b["index"])
    return result


def _collapse_newlines(spans: list[dict]) -> list[dict]:
    """A title's newlines and the whitespace after them as one space (docvortex
    ``postprocess.content.collapse_inline_newlines``)."""
    out = []
    for span in spans:
        if span["type"] == "text":
            span = {**span, "content": re.sub(r"\n\s*", " ", span["content"])}
        out.append(span)
    return _merge_spans(out)


def _calc_bbox(bbox: list[float]) -> tuple[float, float, float, float]:
    """Boxes scaled to 0..1000 for the geometric rules (as docvortex computes them)."""
    if all(v <= 1 for v in bbox):
        return bbox[0] * 1000, bbox[1] * 1000, bbox[2] * 1000, bbox[3] * 1000
    return tuple(bbox)  # type: ignore[return-value]


def _inside_ratio(inner: tuple, outer: tuple) -> float:
    x1, y1, x2, y2 = max(inner[0], outer[0]), max(inner[1], outer[1]), min(inner[2], outer[2]), min(inner[3], outer[3])
    if x2 <= x1 or y2 <= y1:
        return 0.0
    area = max(0.0, (inner[2] - inner[0]) * (inner[3] - inner[1]))
    return (x2 - x1) * (y2 - y1) / area if area > 0 else 0.0


def _lists_and_indexes(model: list[dict]) -> tuple[list, list, list, list]:
    """Text and ref_text at least 80 % inside a list box become its items (first list wins); an
    empty list is dropped; its ``sub_type`` is its items' most common type. ``index`` blocks are
    split into one text child per line.

    Mirrors docvortex ``postprocess.lists.fix_pdf_list_blocks`` and ``fix_pdf_index_blocks``.
    """
    texts = [b for b in model if b["type"] == "text"]
    refs = [b for b in model if b["type"] == "ref_text"]
    lists = [b for b in model if b["type"] == "list"]
    indexes = [b for b in model if b["type"] == "index"]
    for item in lists:
        item["content"] = []
    for block in texts + refs:
        for item in lists:
            if _inside_ratio(_calc_bbox(block["bbox"]), _calc_bbox(item["bbox"])) >= 0.8:
                item["content"].append(block)
                (texts if block in texts else refs).remove(block)
                break
    lists = [item for item in lists if item["content"]]
    for item in lists:
        counts: dict[str, int] = {}
        for child in item["content"]:
            counts[child["type"]] = counts.get(child["type"], 0) + 1
        item["sub_type"] = max(counts, key=counts.get)  # type: ignore[arg-type]
    for item in indexes:
        content = item.get("content")
        spans: list[dict] = content if isinstance(content, list) else []
        item["content"] = [{"type": "text", "content": line} for line in _split_lines(spans)]
    return lists, texts, refs, indexes


def _split_lines(spans: list[dict]) -> list[list[dict]]:
    lines: list[list[dict]] = [[]]
    for span in spans:
        if span["type"] != "text":
            lines[-1].append(span)
            continue
        pieces = span["content"].split("\n")
        for n, piece in enumerate(pieces):
            if n:
                lines.append([])
            if piece:
                lines[-1].append({"type": "text", "content": piece})
    return [line for line in lines if line]


def _kind(block: dict) -> str | None:
    entry = _CHILD_KIND.get(block["type"])
    return entry[1] if entry else None


def _caption_fallbacks(model: list[dict]) -> None:
    """docvortex's caption fallbacks with bboxes: a text/footnote on the same line as a caption
    right above a visual body becomes a caption; single-line text/footnote fragments in the caption
    cluster right above a table become captions; single-line "continued" text leading the page right
    above a table becomes a caption.

    Mirrors docvortex ``postprocess.visual.fallback_inline_caption_fragments`` and
    ``fallback_leading_table_continuation_captions``.
    """
    ordered = sorted(model, key=lambda b: b["index"])
    if len(model) >= 3:
        for pos, block in enumerate(ordered):
            if block["type"] not in ("text", "footnote"):
                continue
            prev_block = _effective(ordered, pos, -1)
            next_block = _effective(ordered, pos, 1)
            if (
                prev_block is not None
                and next_block is not None
                and prev_block["type"] == "caption"
                and next_block["type"] in VISUAL_MAIN
                and _same_line_caption(prev_block, block, next_block)
            ):
                block["type"] = "caption"
        for table in model:
            if table["type"] != "table_body":
                continue
            cluster = _stacked_cluster(table, model)
            last = max((i for i, b in enumerate(cluster) if b["type"] == "caption"), default=None)
            if last is None:
                continue
            for block in cluster[last + 1 :]:
                if block["type"] in ("text", "footnote"):
                    block["type"] = "caption"
    effective = [b for b in ordered if b["type"] not in TRANSPARENT]
    leading = []
    for block in effective:
        if block["type"] in ("text", "footnote") and is_table_continuation_text(plain_text(block.get("content"))):
            leading.append(block)
        else:
            break
    if leading and len(effective) > len(leading) and effective[len(leading)]["type"] == "table_body":
        table = effective[len(leading)]
        next_top, max_height = _calc_bbox(table["bbox"])[1], 1.0
        for block in reversed(leading):
            box = _calc_bbox(block["bbox"])
            height = max(box[3] - box[1], 1)
            gap = next_top - box[3]
            if (
                not _near_table(block, table)
                or gap > max(12, max(max_height, height) * 1.5)
                or gap < -max(2, height * 0.3)
            ):
                return
            next_top, max_height = box[1], max(max_height, height)
        for block in leading:
            block["type"] = "caption"


def _effective(ordered: list[dict], pos: int, step: int) -> dict | None:
    i = pos + step
    while 0 <= i < len(ordered):
        if ordered[i]["type"] not in TRANSPARENT:
            return ordered[i]
        i += step
    return None


def _same_line_caption(caption: dict, text: dict, visual: dict) -> bool:
    c, t, v = _calc_bbox(caption["bbox"]), _calc_bbox(text["bbox"]), _calc_bbox(visual["bbox"])
    ch, th = max(c[3] - c[1], 1), max(t[3] - t[1], 1)
    overlap = min(c[3], t[3]) - max(c[1], t[1])
    center_diff = abs((c[1] + c[3]) / 2 - (t[1] + t[3]) / 2)
    if not (overlap / max(min(ch, th), 1) >= 0.6 or center_diff <= max(ch, th) * 0.5):
        return False
    return 0 <= v[1] - max(c[3], t[3]) <= max(12, max(ch, th) * 1.5)


def _near_table(block: dict, table: dict) -> bool:
    t, b = _calc_bbox(table["bbox"]), _calc_bbox(block["bbox"])
    tolerance = max(12, max(t[2] - t[0], 1) * 0.03)
    return not (b[2] < t[0] - tolerance or b[0] > t[2] + tolerance)


def _stacked_cluster(table: dict, model: list[dict]) -> list[dict]:
    top = _calc_bbox(table["bbox"])[1]
    above = [
        b
        for b in model
        if b is not table
        and b["type"] in ("caption", "text", "footnote")
        and _calc_bbox(b["bbox"])[3] <= top
        and _near_table(b, table)
    ]
    cluster, next_top, max_height = [], top, 1.0
    for block in sorted(above, key=lambda b: (_calc_bbox(b["bbox"])[1], b["index"]), reverse=True):
        box = _calc_bbox(block["bbox"])
        height = max(box[3] - box[1], 1)
        if not 0 <= next_top - box[3] <= max(12, max(max_height, height) * 1.5):
            break
        cluster.append(block)
        next_top, max_height = box[1], max(max_height, height)
    return list(reversed(cluster))


def _regroup_visuals(model: list[dict]) -> tuple[list[dict], list[dict]]:
    """Visual bodies grouped with their captions / footnotes (docvortex
    ``postprocess.visual.regroup_visual_blocks``)."""
    ordered = sorted(model, key=lambda b: b["index"])
    relation = [b for b in ordered if not (b["type"] == "list" and not b.get("content"))]
    position = {b["index"]: p for p, b in enumerate(relation)}
    mains = [b for b in relation if b["type"] in VISUAL_MAIN]
    children = [b for b in relation if b["type"] in _CHILD_KIND]
    grouped: dict[int, dict[str, list]] = {m["index"]: {"caption": [], "footnote": []} for m in mains}
    unmatched = []
    for child in children:
        want, kind = _CHILD_KIND[child["type"]]
        candidates = [m for m in mains if want is None or VISUAL_MAIN[m["type"]] == want]
        parent = _best_parent(child, kind, candidates, relation, position)
        if parent is None:
            unmatched.append(child)
        else:
            grouped[parent["index"]][kind].append(child)
    groups = []
    for main in mains:
        visual = VISUAL_MAIN[main["type"]]
        body = deepcopy(main)
        body.pop("sub_type", None)
        parts = [body]
        for kind in ("caption", "footnote"):
            for child in sorted(grouped[main["index"]][kind], key=lambda b: b["index"]):
                parts.append({**deepcopy(child), "type": f"{visual}_{kind}"})
        group = {"index": main["index"], "type": visual, "content": sorted(parts, key=lambda b: b["index"])}
        if main.get("sub_type"):
            group["sub_type"] = main["sub_type"]
        group["bbox"] = list(main["bbox"])
        groups.append(group)
    return groups, unmatched


def _best_parent(child: dict, kind: str, mains: list[dict], relation: list[dict], position: dict) -> dict | None:
    candidates = [m for m in mains if _is_neighbor(child, kind, m, relation, position)]
    if not candidates:
        return None
    diffs = {m["index"]: _index_diff(child, kind, m, relation, position) for m in candidates}
    best = min(diffs.values())
    closest = [m for m in candidates if diffs[m["index"]] == best]
    if len(closest) == 1:
        return closest[0]
    child_box = _calc_bbox(child["bbox"])
    distances = [(m, _bbox_distance(child_box, _calc_bbox(m["bbox"]))) for m in closest]
    values = [d for _, d in distances]
    if max(values) - min(values) > 2:
        return min(distances, key=lambda md: (md[1], md[0]["index"]))[0]
    if kind == "caption" and all(VISUAL_MAIN[m["type"]] == "table" for m in closest):
        return max(closest, key=lambda m: m["index"])
    if kind == "footnote":
        return min(closest, key=lambda m: m["index"])
    return min(closest, key=lambda m: (_center_distance(child_box, _calc_bbox(m["bbox"])), m["index"]))


def _is_neighbor(child: dict, kind: str, main: dict, relation: list[dict], position: dict) -> bool:
    if kind == "footnote" and child["index"] < main["index"]:
        return False
    allowed = {"caption"} if kind == "caption" else {"caption", "footnote"}
    a, b = position[child["index"]], position[main["index"]]
    for between in relation[min(a, b) + 1 : max(a, b)]:
        if _kind(between) in allowed:
            continue
        if _outside_gap(between, child, main):
            continue
        return False
    return True


def _outside_gap(between: dict, child: dict, main: dict) -> bool:
    c, m, x = _calc_bbox(child["bbox"]), _calc_bbox(main["bbox"]), _calc_bbox(between["bbox"])
    if c[3] <= m[1]:
        gap = (c[3], m[1])
    elif m[3] <= c[1]:
        gap = (m[3], c[1])
    else:
        return False
    if _overlaps(x, c) or _overlaps(x, m):
        return False
    return not (x[1] < gap[1] and x[3] > gap[0])


def _overlaps(a: tuple, b: tuple) -> bool:
    return not (a[2] <= b[0] or a[0] >= b[2] or a[3] <= b[1] or a[1] >= b[3])


def _index_diff(child: dict, kind: str, main: dict, relation: list[dict], position: dict) -> int:
    a, b = position[child["index"]], position[main["index"]]
    start, end = min(a, b), max(a, b)
    skipped = sum(1 for block in relation[start + 1 : end] if _kind(block) == kind)
    return end - start - skipped


def _bbox_distance(a: tuple, b: tuple) -> float:
    left, right, bottom, top = b[2] < a[0], a[2] < b[0], b[3] < a[1], a[3] < b[1]
    if top and left:
        return math.hypot(a[0] - b[2], a[3] - b[1])
    if left and bottom:
        return math.hypot(a[0] - b[2], a[1] - b[3])
    if bottom and right:
        return math.hypot(a[2] - b[0], a[1] - b[3])
    if right and top:
        return math.hypot(a[2] - b[0], a[3] - b[1])
    if left:
        return a[0] - b[2]
    if right:
        return b[0] - a[2]
    if bottom:
        return a[1] - b[3]
    if top:
        return b[1] - a[3]
    return 0.0


def _center_distance(a: tuple, b: tuple) -> float:
    return math.hypot((a[0] + a[2]) / 2 - (b[0] + b[2]) / 2, (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2)
