"""A table split across a page break, joined into one table as mineru 4.0.12 joins it.

Facts follow docvortex 0.6.4 ``content.table`` (``document.merge_table`` marks a table that opens a
page as continuing the one that closed the page before; ``content._merge_table_content_with_columns``
joins them when Markdown is rendered). Tables here are page-model groups (``mineru4.page_model``):
``{"type": "table", "bbox", "content": [caption / body / footnote children]}`` with the body's HTML
in ``table_body``'s ``content``.

Ported for tables as the VLM writes them: the decision (``can_merge_tables``: captions and
footnotes, widths within 10 %, column counts or boundary rows) and the join (``merge_tables``:
repeated header rows dropped with the rows their cells span, the narrower grid's column spans
widened onto the wider one's through the boundary rows, empty row-span placeholders under spans
from the page before cut, the continuation's rows appended, its footnotes kept). Not ported:
official's per-cell joins across the break (``cell_merge`` flags, written only by its optional
LLM-aided step, off by default, or its VLM cross-page step, off in mineru 4.0.12) and its refusal
for captions carrying bookmark anchors (which VLM pages never have).
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

from bs4 import BeautifulSoup, Tag

from mineru_fast.results.mineru4 import full_to_half, is_table_continuation_text

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

    tree: BeautifulSoup
    container: Tag  # the first ``tbody``, else the first ``table``: where joined rows go
    rows: list[Tag]
    cells: list[list[Tag]]
    owners: list[dict[int, tuple[int, int]]]
    columns: int
    tail: dict[int, set[int]]


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


def _cells(node: Tag) -> list[Tag]:
    """The ``td`` / ``th`` elements inside ``node``, nested ones included."""
    return list(node.find_all(["td", "th"]))


def _span(cell: Tag, name: str) -> int:
    """A cell's ``colspan`` or ``rowspan`` (docvortex ``html._colspan`` / ``_rowspan``).

    Raises:
        ValueError: a value that is not an integer (then the tables are not joined).
    """
    return int(str(cell.get(name, "1")))  # single-valued attributes: beautifulsoup keeps them strings


def _grid(table: dict) -> _Grid | None:
    """The grid of a table's body, or None when it has no rows (docvortex ``_build_table_state``).

    Raises:
        ValueError: a span that is not an integer.
    """
    body = _body(table)
    markup = body.get("content") if body is not None else None
    if not isinstance(markup, str) or not markup:
        return None
    tree = BeautifulSoup(markup, "html.parser")
    container = tree.find("tbody") or tree.find("table")
    rows = list(tree.find_all("tr"))
    if container is None or not rows:
        return None
    cells, owners, columns, tail = _scan(rows)
    if columns <= 0 or not any(cells):
        return None
    return _Grid(tree, container, rows, cells, owners, columns, tail)


def _grids(first: dict, second: dict) -> tuple[_Grid, _Grid] | None:
    """The grids of two tables, or None when either has no rows or a span that is not an integer."""
    try:
        grids = _grid(first), _grid(second)
    except ValueError:
        return None
    if grids[0] is None or grids[1] is None:
        return None
    return grids[0], grids[1]


def _scan(
    rows: list[Tag],
) -> tuple[list[list[Tag]], list[dict[int, tuple[int, int]]], int, dict[int, set[int]]]:
    """``(cells per row, column owners per row, column count, tail)`` of rows: cells placed left to
    right past the columns row spans from above hold (docvortex ``html._scan_rows``); ``tail`` maps
    rows below the last (0 = the first one below) to the columns row spans still hold there."""
    cells = [_cells(row) for row in rows]
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
    owners = [occupied.get(r, {}) for r in range(len(rows))]
    tail = {r - len(rows): set(occupied[r]) for r in occupied if r >= len(rows) and occupied[r]}
    return cells, owners, columns, tail


def _has_content(cell: Tag) -> bool:
    """Visible text or a visual element (docvortex ``content._cell_has_semantic_content``)."""
    if cell.get_text(strip=True):
        return True
    return cell.find(["img", "svg", "math", "eq", "table", "figure", "object", "embed", "canvas"]) is not None


def _start_columns(rows: list[Tag], r: int) -> list[int]:
    """The first column of each cell of row ``r`` (docvortex ``html.build_visual_col_mapping``)."""
    _, owners, _, _ = _scan(rows[: r + 1])
    starts, column = [], 0
    for cell in _cells(rows[r]):
        while column in owners[r] and owners[r][column][0] < r:
            column += 1
        starts.append(column)
        column += _span(cell, "colspan")
    return starts


def _clip_blank_row_spans(rows: list[Tag], held: dict[int, set[int]]) -> None:
    """Empty row-spanning cells of the continuation that lie under row spans still running from the
    page before are cut by the rows they overlap (a cell moved down keeps the rest of its span)
    (docvortex ``content._clip_overlapped_blank_rowspan_cells``)."""
    removed, moved = [], []
    for r, row in enumerate(rows):
        for cell, start in zip(_cells(row), _start_columns(rows, r), strict=False):
            rowspan = _span(cell, "rowspan")
            if rowspan <= 1 or _has_content(cell):
                continue
            columns = set(range(start, start + _span(cell, "colspan")))
            overlap = 0
            while columns and overlap < rowspan and columns <= held.get(r + overlap, set()):
                overlap += 1
            if not columns or overlap == 0 or (rowspan > overlap and r + overlap >= len(rows)):
                continue
            removed.append(cell)
            if rowspan > overlap:
                copy = deepcopy(cell)
                if rowspan - overlap > 1:
                    copy["rowspan"] = str(rowspan - overlap)
                else:
                    copy.attrs.pop("rowspan", None)
                moved.append((r + overlap, start, copy))
    for cell in removed:
        cell.extract()
    for r, start, cell in sorted(moved, key=lambda m: (m[0], m[1]), reverse=True):
        targets = _cells(rows[r])
        before = next((t for t, s in zip(targets, _start_columns(rows, r), strict=False) if s >= start), None)
        if before is None:
            rows[r].append(cell)
        else:
            before.insert_before(cell)


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


def _placements(rows: list[Tag], columns: int) -> list[tuple[Tag, int, int]] | None:
    """``(cell, first column, end column)`` of each row's own cells when ``rows`` form a whole grid
    of ``columns``: no nested table, spans covering every column of every row once; else None
    (docvortex ``grid._snapshot_table_grid``)."""
    occupied: dict[int, set[int]] = {}
    placed = []
    for r, row in enumerate(rows):
        owned = occupied.setdefault(r, set())
        column = 0
        for cell in row.find_all(["td", "th"], recursive=False):
            if cell.find("table") is not None:
                return None
            while column in owned:
                column += 1
            colspan, rowspan = _span(cell, "colspan"), _span(cell, "rowspan")
            if colspan <= 0 or rowspan <= 0 or column + colspan > columns:
                return None
            for dr in range(rowspan):
                target = occupied.setdefault(r + dr, set())
                if target & set(range(column, column + colspan)):
                    return None
                target.update(range(column, column + colspan))
            placed.append((cell, column, column + colspan))
            column += colspan
        if owned != set(range(columns)):
            return None
    return placed


def _boundaries(source: _Grid, source_row: int, target: _Grid, target_row: int) -> dict[int, int] | None:
    """Column boundaries of ``source`` mapped onto ``target`` by pairing the rendered cells of two
    boundary rows in order, or None when they do not pair (a gap, another count, a grid not
    covered, equal widths with other cell edges) (docvortex ``grid._boundary_column_mapping``)."""
    source_cells, target_cells = _segments(source, source_row), _segments(target, target_row)
    if not source_cells or len(source_cells) != len(target_cells):
        return None
    mapping, source_end, target_end = {0: 0}, 0, 0
    for (source_start, source_stop), (target_start, target_stop) in zip(source_cells, target_cells, strict=True):
        if source_start != source_end or target_start != target_end:
            return None
        source_end, target_end = source_stop, target_stop
        mapping[source_end] = target_end
    if source_end != source.columns or target_end != target.columns:
        return None
    if source.columns == target.columns:  # equal widths: the same edges, then every column maps to itself
        return None if any(a != b for a, b in mapping.items()) else {c: c for c in range(source.columns + 1)}
    return mapping


def _normalized(cell: Tag) -> str:
    """A cell's half-width text without whitespace (docvortex ``html._normalize_cell_text``)."""
    return "".join(full_to_half(cell.get_text(), punctuation=True).split())


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
    bodies have rows; the column counts are equal, or else the boundary rows agree
    (``_rows_match``).

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
    grids = _grids(current, previous)
    if grids is None:
        return False
    grid_a, grid_b = grids
    return grid_a.columns == grid_b.columns or _rows_match(grid_b, grid_a)


def _rows_match(previous: _Grid, current: _Grid) -> bool:
    """Whether the last non-empty row before the break and the continuation's first row after its
    header rows cover as many columns, hold as many column units or render as many cells
    (docvortex ``structure.check_rows_match``; the first row is looked for among the first six)."""
    last = max(r for r, row in enumerate(previous.cells) if row)
    first = _header_rows(previous, current)
    if first >= min(len(current.rows), MAX_HEADER_ROWS + 1):
        return False

    def effective(grid: _Grid, r: int) -> int:
        return max(grid.owners[r], default=-1) + 1

    def units(grid: _Grid, r: int) -> int:
        return sum(_span(cell, "colspan") for cell in grid.cells[r])

    return (
        effective(previous, last) == effective(current, first)
        or units(previous, last) == units(current, first)
        or len(_segments(previous, last)) == len(_segments(current, first))
    )


def merge_tables(previous: dict, current: dict) -> dict | None:
    """``previous`` with ``current`` joined into it, or None when they are not joined.

    Mirrors docvortex ``content.table.content._merge_table_content_with_columns`` (see the module
    docstring): the rows ``current`` repeats at its top are dropped; when the continuation's first
    row and the last row before the break pair cell by cell, the narrower grid's column spans are
    widened onto the wider one's columns and the rows appended to ``previous``'s body (its markup
    written anew with ``str()`` of its BeautifulSoup tree), ``previous``'s footnotes replaced by ``current``'s (indexed
    after the body); ``current``'s captions are not kept. Neither input is changed.

    Args:
        previous: the table so far (a page-model group, possibly joined before).
        current: the continuation.

    Returns:
        The joined table (a new group), or None.
    """
    if not can_merge_tables(current, previous):
        return None
    previous, current = deepcopy(previous), deepcopy(current)
    grids = _grids(previous, current)
    if grids is None:
        return None
    grid_a, grid_b = grids
    appended = grid_b.rows[_header_rows(grid_a, grid_b) :]
    header, last = len(grid_b.rows) - len(appended), len(grid_a.rows) - 1
    placed_a, placed_b = _placements(grid_a.rows, grid_a.columns), _placements(grid_b.rows, grid_b.columns)
    if not appended or placed_a is None or placed_b is None:
        return None
    # The narrower grid's column edges mapped onto the wider one through the boundary rows.
    map_a: dict[int, int] | None = {c: c for c in range(grid_a.columns + 1)}
    map_b: dict[int, int] | None = {c: c for c in range(grid_b.columns + 1)}
    if grid_a.columns >= grid_b.columns:
        map_b = _boundaries(grid_b, header, grid_a, last)
    else:
        map_a = _boundaries(grid_a, last, grid_b, header)
    if map_a is None or map_b is None:
        return None
    pairs = ((placed_a, map_a), (placed_b, map_b))
    if any(start not in m or end not in m for placed, m in pairs for _, start, end in placed):
        return None  # a cell edge the other grid does not have
    for placed, mapping in pairs:
        for cell, start, end in placed:
            if mapping[end] - mapping[start] != end - start:
                cell.attrs["colspan"] = str(mapping[end] - mapping[start])
    _clip_blank_row_spans(appended, _scan(grid_a.rows)[3])
    if _placements(grid_a.rows + appended, max(grid_a.columns, grid_b.columns)) is None:
        return None
    for row in appended:
        grid_a.container.append(row)
    body = _body(previous)
    assert body is not None  # _grid found it
    body["content"] = str(grid_a.tree)
    kept = [c for c in previous["content"] if not (isinstance(c, dict) and c.get("type") == "table_footnote")]
    indices = [c["index"] for c in kept if isinstance(c, dict) and isinstance(c.get("index"), int)]
    base = max(indices) if isinstance(body.get("index"), int) else None
    footnotes = [c for c in _children(current) if c.get("type") == "table_footnote"]
    for offset, footnote in enumerate(footnotes, start=1):
        kept.append({**footnote, "index": 0 if base is None else base + offset})
    previous["content"] = kept
    return previous
