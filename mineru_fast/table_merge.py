"""A table split across a page break, joined into one table as mineru 4.0.12 joins it.

Facts follow docvortex 0.6.4 ``content.table`` (``document.merge_table`` marks a table that opens a
page as continuing the one that closed the page before; ``content._merge_table_content_with_columns``
joins them when Markdown is rendered). Tables here are page-model groups (``mineru4.page_model``):
``{"type": "table", "bbox", "content": [caption / body / footnote children]}`` with the body's HTML
in ``table_body``'s ``content``.

Ported: the decision (``can_merge_tables``: captions and footnotes, widths within 10 %, column
counts) and the join of two grids of the same column count (``merge_tables``: repeated header rows
dropped, with their row spans; the continuation's rows appended when its first row's cells line up
with the previous table's last row; its footnotes kept). Not ported: official's alignment of grids
whose column counts differ (``content.table.grid``) and of row spans that run past the break; such
parts stay two tables here (README, "Output format").
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

from .html_fragment import Element, Text, parse_fragment, serialize
from .mineru4 import full_to_half, is_table_continuation_text

__all__ = ["can_merge_tables", "merge_tables"]

MAX_HEADER_ROWS = 5  # docvortex content/table/models.py
WIDTH_TOLERANCE = 0.1  # docvortex structure._table_widths_are_compatible: relative width difference


@dataclass
class _Grid:
    """What the rules read of a table body (docvortex ``TableMergeState``, ``html._scan_rows``).

    ``cells[r]`` are row ``r``'s cells (nested ones included, as official counts them),
    ``owners[r]`` maps each column row ``r`` covers to the ``(row, cell)`` that covers it (row spans
    included), ``tail`` the columns row spans hold below the last row.
    """

    tree: Element
    container: Element  # the first ``tbody``, else the first ``table``: where joined rows go
    rows: list[Element]
    cells: list[list[Element]]
    owners: list[dict[int, tuple[int, int]]]
    columns: int
    tail: bool


def _calc_box(bbox: Any) -> tuple[int, int, int, int] | None:
    """A 0..1 box as integers on 0..1000 (docvortex ``blocks._bbox_for_calculation``)."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        return None
    values = [float(v) for v in bbox]
    if not all(math.isfinite(v) and 0 <= v <= 1 for v in values):
        return None
    x0, y0, x1, y1 = (int(round(v * 1000)) for v in values)
    return (x0, y0, x1, y1) if x1 > x0 and y1 > y0 else None


def _children(table: dict) -> list[dict]:
    content = table.get("content")
    return [c for c in content if isinstance(c, dict)] if isinstance(content, list) else []


def _body(table: dict) -> dict | None:
    return next((c for c in _children(table) if c.get("type") == "table_body"), None)


def _text(block: dict) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(_text(c) for c in content if isinstance(c, dict)) if isinstance(content, list) else ""


def _find_all(node: Element, names: set[str]) -> list[Element]:
    return [e for e in node.iter() if e.name in names]


def _span(cell: Element, name: str) -> int:
    return int(cell.attrs.get(name, "1"))  # int() of a bad value raises ValueError: no join


def _grid(table: dict) -> _Grid | None:
    """The grid of a table's body, or None when it has no rows (docvortex ``_build_table_state``).

    Raises:
        ValueError: a span that is not an integer.
    """
    body = _body(table)
    markup = body.get("content") if body is not None else None
    if not isinstance(markup, str) or not markup:
        return None
    tree = parse_fragment(markup)
    container = next((e for e in tree.iter() if e.name == "tbody"), None) or next(
        (e for e in tree.iter() if e.name == "table"), None
    )
    rows = _find_all(tree, {"tr"})
    if container is None or not rows:
        return None
    cells = [_find_all(row, {"td", "th"}) for row in rows]
    occupied: dict[int, dict[int, tuple[int, int]]] = {}
    columns = 0
    for r, row_cells in enumerate(cells):
        owned = occupied.setdefault(r, {})
        column = 0
        for i, cell in enumerate(row_cells):
            while column in owned:
                column += 1
            colspan, rowspan = _span(cell, "colspan"), _span(cell, "rowspan")
            for dr in range(rowspan):
                occupied.setdefault(r + dr, {}).update(dict.fromkeys(range(column, column + colspan), (r, i)))
            column += colspan
            columns = max(columns, column)
        columns = max(columns, max(owned, default=-1) + 1)
    if columns <= 0 or not any(cells):
        return None
    owners = [occupied.get(r, {}) for r in range(len(rows))]
    tail = any(occupied[r] for r in occupied if r >= len(rows))
    return _Grid(tree, container, rows, cells, owners, columns, tail)


def _segments(grid: _Grid, row: int) -> list[tuple[int, int]]:
    """The ``(first, end)`` columns of each rendered cell of a row: runs of columns one cell covers,
    cells spanning down from rows above included (docvortex ``html.build_row_rendered_cell_segments``)."""
    out: list[tuple[int, int]] = []
    owner, start = None, 0
    for column in range(grid.columns + 1):
        current = grid.owners[row].get(column) if column < grid.columns else None
        if current != owner:
            if owner is not None:
                out.append((start, column))
            owner, start = current, column
    return out


def _whole(grid: _Grid, rows: list[Element]) -> bool:
    """Whether ``rows`` form a whole grid of ``grid.columns``: each row's own cells (no nested
    table) with their spans cover every column once (docvortex ``grid._snapshot_table_grid``)."""
    occupied: dict[int, set[int]] = {}
    for r, row in enumerate(rows):
        owned = occupied.setdefault(r, set())
        column = 0
        for cell in (c for c in row.children if isinstance(c, Element) and c.name in ("td", "th")):
            if _find_all(cell, {"table"}):
                return False
            while column in owned:
                column += 1
            colspan, rowspan = _span(cell, "colspan"), _span(cell, "rowspan")
            if colspan <= 0 or rowspan <= 0 or column + colspan > grid.columns:
                return False
            for dr in range(rowspan):
                target = occupied.setdefault(r + dr, set())
                if target & set(range(column, column + colspan)):
                    return False
                target.update(range(column, column + colspan))
            column += colspan
        if owned != set(range(grid.columns)):
            return False
    return True


def _cell_text(cell: Element | Text) -> str:
    """A cell's text as beautifulsoup's ``get_text`` reads it: character data and CDATA."""
    if isinstance(cell, Text):
        return cell.value if (cell.kind == "text" and cell.container == "plain") or cell.kind == "cdata" else ""
    return "".join(_cell_text(child) for child in cell.children)


def _normalized(cell: Element) -> str:
    return "".join(full_to_half(_cell_text(cell), punctuation=True).split())


def _header_rows(previous: _Grid, current: _Grid) -> int:
    """How many leading rows the continuation repeats, up to five, widened to the rows its header
    cells span (docvortex ``structure.detect_table_headers`` and ``_expand_header_count_by_rowspan``).

    A row repeats when its cells, their spans, the columns it covers and their half-width text
    without whitespace are the same; failing that on the first row, when its texts and rendered
    cells are.
    """

    def signature(grid: _Grid, r: int) -> tuple:
        row = grid.cells[r]
        spans = tuple((_span(c, "colspan"), _span(c, "rowspan")) for c in row)
        return spans, max(grid.owners[r], default=-1) + 1, tuple(_normalized(c) for c in row)

    rows = min(len(previous.rows), len(current.rows), MAX_HEADER_ROWS)
    count = next((r for r in range(rows) if signature(previous, r) != signature(current, r)), rows)
    if count == 0:
        for r in range(rows):
            same_text = [_normalized(c) for c in previous.cells[r]] == [_normalized(c) for c in current.cells[r]]
            if not same_text or len(_segments(previous, r)) != len(_segments(current, r)):
                break
            count += 1
    expanded, r = min(count, len(current.rows)), 0
    while r < expanded:
        for cell in current.cells[r]:
            if _span(cell, "rowspan") > 1:
                expanded = min(max(expanded, r + _span(cell, "rowspan")), len(current.rows))
        r += 1
    return expanded


def _caption_continues(table: dict, caption: dict) -> bool | None:
    """True: a "continued" caption; False: a caption that blocks the join; None: a caption below
    the body without the marker (a new paragraph mistaken for a caption, which is ignored)."""
    if is_table_continuation_text(_text(caption)):
        return True
    body = _body(table)
    body_box, caption_box = _calc_box(body.get("bbox") if body else None), _calc_box(caption.get("bbox"))
    if body_box is not None and caption_box is not None and caption_box[1] >= body_box[3]:
        return None
    return False


def can_merge_tables(current: dict, previous: dict) -> bool:
    """Whether ``current`` (opening a page) continues ``previous`` (closing the page before).

    Mirrors docvortex ``content.table.structure.can_merge_tables``: the continuation's captions
    (those not below its body without a marker) must all be absent or one say "continued" (then the
    previous table may have one footnote, else none); the widths differ by less than 10 %; both
    bodies have rows; the column counts are equal (official also joins tables whose boundary rows
    line up when the counts differ: not ported, see the module docstring).

    Args:
        current, previous: page-model table groups.
    """
    footnotes = sum(1 for c in _children(previous) if c.get("type") == "table_footnote")
    captions = [_caption_continues(current, c) for c in _children(current) if c.get("type") == "table_caption"]
    captions = [c for c in captions if c is not None]
    if captions:
        if not any(captions) or footnotes > 1:
            return False
    elif footnotes > 0:
        return False
    a, b = _calc_box(current.get("bbox")), _calc_box(previous.get("bbox"))
    if a is None or b is None:
        return False
    width_a, width_b = a[2] - a[0], b[2] - b[0]
    if min(width_a, width_b) <= 0 or abs(width_a - width_b) / min(width_a, width_b) >= WIDTH_TOLERANCE:
        return False
    try:
        grid_a, grid_b = _grid(current), _grid(previous)
    except ValueError:
        return False
    return grid_a is not None and grid_b is not None and grid_a.columns == grid_b.columns


def merge_tables(previous: dict, current: dict, columns: Any = None) -> tuple[dict, Any] | None:
    """``previous`` with ``current`` joined into it, or None when they are not joined.

    Mirrors docvortex ``content.table.content._merge_table_content_with_columns`` for two plain
    grids (see the module docstring): the rows ``current`` repeats at its top are dropped, the
    others appended to ``previous``'s body (its markup written anew, ``html_fragment``),
    ``previous``'s footnotes replaced by ``current``'s (indexed after the body); ``current``'s
    captions are not kept. Neither input is changed.

    Args:
        previous: the table so far (a page-model group, possibly joined before).
        current: the continuation.
        columns: what an earlier join returned as its second item (official's column mapping,
            the identity here).

    Returns:
        ``(joined table, column mapping)`` or None.
    """
    if not can_merge_tables(current, previous):
        return None
    previous, current = deepcopy(previous), deepcopy(current)
    try:
        grid_a, grid_b = _grid(previous), _grid(current)
    except ValueError:
        return None
    if grid_a is None or grid_b is None or grid_a.columns != grid_b.columns or grid_a.tail:
        return None
    header = _header_rows(grid_a, grid_b)
    appended = grid_b.rows[header:]
    if not appended or not (_whole(grid_a, grid_a.rows) and _whole(grid_b, grid_b.rows)):
        return None
    boundary = _segments(grid_b, header)
    covered = [start for start, _ in boundary] == [0, *(end for _, end in boundary[:-1])]
    if not boundary or not covered or boundary[-1][1] != grid_a.columns:
        return None  # the continuation's first row leaves a gap (official: no column mapping)
    if boundary != _segments(grid_a, len(grid_a.rows) - 1) or not _whole(grid_a, grid_a.rows + appended):
        return None  # the boundary rows' cells do not line up
    grid_a.container.children.extend(appended)
    body = _body(previous)
    assert body is not None  # _grid found it
    body["content"] = serialize(grid_a.tree)
    kept = [c for c in previous["content"] if not (isinstance(c, dict) and c.get("type") == "table_footnote")]
    indices = [c["index"] for c in kept if isinstance(c, dict) and isinstance(c.get("index"), int)]
    base = max(indices) if isinstance(body.get("index"), int) else None
    footnotes = [c for c in _children(current) if c.get("type") == "table_footnote"]
    for offset, footnote in enumerate(footnotes, start=1):
        kept.append({**footnote, "index": 0 if base is None else base + offset})
    previous["content"] = kept
    return previous, columns
