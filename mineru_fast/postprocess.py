"""Turn raw content-step outputs into final block contents (pure Python, no torch).

Tables arrive as OTSL (Optimized Table Structure Language: one token per grid cell, ``<fcel>``
full cell followed by its text, ``<ecel>`` empty cell, ``<lcel>`` merged with the cell on its
left, ``<ucel>`` merged with the cell above, ``<xcel>`` merged both ways, ``<nl>`` end of row)
and become HTML with rowspan/colspan. Equations lose their delimiters and get balanced braces and
``\\left``/``\\right`` pairs. Text is stripped.
"""

from __future__ import annotations

import html
import re

__all__ = ["otsl_to_html", "clean_equation", "postprocess_content"]

_OTSL_CELL_RE = re.compile(r"(<fcel>|<ecel>|<lcel>|<ucel>|<xcel>)")


def _otsl_grid(otsl: str) -> list[list[tuple[str, str]]]:
    """Rows of ``(token, text)``, padded with ``<ecel>`` to the widest row."""
    rows: list[list[tuple[str, str]]] = []
    for line in otsl.split("<nl>"):
        parts = _OTSL_CELL_RE.split(line)
        cells = [(parts[i], parts[i + 1].strip()) for i in range(1, len(parts) - 1, 2)]
        if cells:
            rows.append(cells)
    width = max((len(r) for r in rows), default=0)
    return [r + [("<ecel>", "")] * (width - len(r)) for r in rows]


def otsl_to_html(otsl: str) -> str:
    """Convert an OTSL table to an HTML ``<table>``.

    Runs of ``<lcel>`` right of a cell give its colspan; runs of ``<ucel>`` below it give its
    rowspan (``<xcel>`` continues both). A merge token with no cell to merge into becomes an empty
    cell, so any token sequence yields valid HTML. Cell text is HTML-escaped.

    Returns:
        ``"<table>...</table>"``; ``"<table></table>"`` when there is no cell token.
    """
    grid = _otsl_grid(otsl)
    n_rows, n_cols = len(grid), len(grid[0]) if grid else 0
    covered = [[False] * n_cols for _ in range(n_rows)]
    out = ["<table>"]
    for r in range(n_rows):
        out.append("<tr>")
        for c in range(n_cols):
            if covered[r][c]:
                continue
            # Every uncovered position starts a cell; an orphan merge token is an empty one.
            token, text = grid[r][c]
            colspan = rowspan = 1
            while c + colspan < n_cols and grid[r][c + colspan][0] in ("<lcel>", "<xcel>"):
                colspan += 1
            while r + rowspan < n_rows and grid[r + rowspan][c][0] in ("<ucel>", "<xcel>"):
                rowspan += 1
            for rr in range(r, r + rowspan):
                for cc in range(c, c + colspan):
                    covered[rr][cc] = True
            attrs = (f' rowspan="{rowspan}"' if rowspan > 1 else "") + (f' colspan="{colspan}"' if colspan > 1 else "")
            body = html.escape(text, quote=False) if token == "<fcel>" else ""
            out.append(f"<td{attrs}>{body}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


_DELIMITERS = [(r"\[", r"\]"), ("$$", "$$"), (r"\(", r"\)"), ("$", "$")]


def _balance_braces(latex: str) -> str:
    depth, kept = 0, []
    i = 0
    while i < len(latex):
        ch = latex[i]
        if ch == "\\" and i + 1 < len(latex):
            kept.append(latex[i : i + 2])
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:  # an unmatched closing brace is dropped
                i += 1
                continue
            depth -= 1
        kept.append(ch)
        i += 1
    return "".join(kept) + "}" * depth


def _balance_left_right(latex: str) -> str:
    lefts = len(re.findall(r"\\left(?![a-zA-Z])", latex))
    rights = len(re.findall(r"\\right(?![a-zA-Z])", latex))
    if lefts > rights:
        latex += r" \right." * (lefts - rights)
    elif rights > lefts:
        latex = r"\left. " * (rights - lefts) + latex
    return latex


def clean_equation(raw: str) -> str:
    """Strip display/inline delimiters and balance ``{}`` and ``\\left``/``\\right`` pairs.

    Returns:
        The LaTeX body without delimiters, e.g. ``"E = mc^2"`` for ``"\\[\\nE = mc^2\\n\\]"``.
    """
    latex = raw.strip()
    for opening, closing in _DELIMITERS:
        if latex.startswith(opening) and latex.endswith(closing) and len(latex) >= len(opening) + len(closing):
            latex = latex[len(opening) : len(latex) - len(closing)].strip()
            break
    latex = re.sub(r"(\\\\\s*)+$", "", latex).strip()  # a trailing line break renders as an empty row
    return _balance_left_right(_balance_braces(latex))


def postprocess_content(block_type: str, raw: str) -> str:
    """Final content of a block from its raw content-step output.

    Tables: OTSL -> HTML (an output that is already HTML is kept). Equations: ``clean_equation``.
    Everything else: surrounding whitespace stripped.
    """
    if block_type == "table":
        text = raw.strip()
        return text if text.lower().startswith("<table") else otsl_to_html(text)
    if block_type == "equation":
        return clean_equation(raw)
    return raw.strip()
