"""A table body (HTML) as MinerU 4 writes it in Markdown: a GitHub pipe table when one can hold
it without loss, with the cells' inline markup kept (emphasis, code spans, links, underline,
super- and subscripts, strikethrough, inline formulas, line breaks), else the HTML itself with
its ``<eq>`` formulas as ``$..$``.

Facts follow mineru 4.0.12's writer, docvortex 0.6.4 ``render._internal.markdown.table``
(``render_html_table``) and the style wrappers of ``render._internal.markdown.inline``: which
tables are "simple", how cell text is escaped (``& < \\ |``), which style sets become Markdown
markers (``**``, ``*``, ``~~``, ``***``) and which HTML tags (in a fixed order), how code spans
are fenced and link targets escaped. Parsed with BeautifulSoup's ``html.parser``, as official
parses them, so malformed markup reads the same on both sides.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable

from bs4 import BeautifulSoup, NavigableString, Tag

__all__ = ["render_table", "format_embedded_html"]

_EQ_RE = re.compile(r"<eq>(?P<latex>.*?)</eq>", re.IGNORECASE | re.DOTALL)
_FORMULA_PIPE = re.compile(r"(\\*)\|")

# A cell holding any of these (or any tag not in _INLINE_TAGS) makes the table "complex": kept as HTML.
_COMPLEX_TAGS = {"blockquote", "div", "dl", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "img", "li", "math"}
_COMPLEX_TAGS |= {"object", "ol", "pre", "svg", "table", "ul"}
_INLINE_TAGS = {"a", "b", "br", "code", "em", "eq", "i", "p", "s", "span", "strong", "sub", "sup", "u"}

# Inline tags that style their text, by the style's name.
_STYLES = {
    "b": "bold",
    "strong": "bold",
    "em": "italic",
    "i": "italic",
    "u": "underline",
    "s": "strikethrough",
    "sup": "superscript",
    "sub": "subscript",
}
# Style sets Markdown has a marker for; any other set is written with HTML tags.
_MARKERS = {
    frozenset({"bold"}): "**",
    frozenset({"italic"}): "*",
    frozenset({"strikethrough"}): "~~",
    frozenset({"bold", "italic"}): "***",
}


def format_embedded_html(markup: str) -> str:
    """HTML kept as HTML in Markdown, each ``<eq>..</eq>`` formula written `` $..$ `` (its
    entities unescaped, its LaTeX stripped).

    Mirrors docvortex ``render._internal.markdown.table.format_embedded_html`` (no asset base URL,
    the default ``$`` delimiters).
    """
    return _EQ_RE.sub(lambda m: f" ${html.unescape(m.group('latex')).strip()}$ ", markup)


def render_table(markup: str) -> str | None:
    """A table body as Markdown.

    Args:
        markup: the table's HTML (one ``<table>`` as the model's output becomes it, OTSL already
            converted), any string.

    Returns:
        A GFM pipe table (first all-``th`` row, else the first row, as its header; short rows
        padded with empty cells) when the markup holds exactly one table whose cells hold only
        inline markup and no spans; the markup as HTML (``format_embedded_html``, stripped) for
        any other table; None when the markup holds no table.
    """
    tables = BeautifulSoup(markup, "html.parser").find_all("table")
    if not tables:
        return None
    if len(tables) != 1 or _is_complex(tables[0]):
        return format_embedded_html(markup).strip()
    rows = tables[0].find_all("tr")
    rendered: list[list[str]] = []
    header_flags: list[list[bool]] = []
    for row in rows:
        cells = row.find_all(("th", "td"), recursive=False)
        if not cells:
            return format_embedded_html(markup).strip()
        rendered.append([_normalize_cell(_inline(cell, ())) for cell in cells])
        header_flags.append([cell.name == "th" for cell in cells])
    if not rendered:
        return format_embedded_html(markup).strip()
    width = max(len(r) for r in rendered)
    for cells_text in rendered:
        cells_text.extend([""] * (width - len(cells_text)))
    header = _header_index(tables[0], header_flags)
    lines = [rendered[header], ["---"] * width, *rendered[:header], *rendered[header + 1 :]]
    return "\n".join(f"| {' | '.join(line)} |" for line in lines)


def _is_complex(table: Tag) -> bool:
    """Whether GFM cannot hold the table: nested tables, a multi-row head, spans, several
    paragraphs in a cell, block or unknown tags, or a span with attributes."""
    if table.find("table") is not None:
        return True
    thead = table.find("thead")
    if thead is not None and len(thead.find_all("tr", recursive=False)) > 1:
        return True
    for cell in table.find_all(("th", "td")):
        if cell.has_attr("rowspan") or cell.has_attr("colspan") or len(cell.find_all("p")) > 1:
            return True
        for node in cell.descendants:
            if not isinstance(node, Tag):
                continue
            if node.name in _COMPLEX_TAGS or node.name not in _INLINE_TAGS or (node.name == "span" and node.attrs):
                return True
    return False


def _header_index(table: Tag, header_flags: list[list[bool]]) -> int:
    thead = table.find("thead")
    if thead is not None and thead.find("tr", recursive=False) is not None:
        return 0
    return next((i for i, flags in enumerate(header_flags) if flags and all(flags)), 0)


def _with_style(styles: tuple[str, ...], name: str | None) -> tuple[str, ...]:
    """``styles`` and the style of tag ``name`` (if it has one), first occurrences kept in order."""
    style = _STYLES.get(name or "")
    return tuple(dict.fromkeys((*styles, style))) if style is not None else styles


def _inline(node: Tag, styles: tuple[str, ...]) -> str:
    """The Markdown of a simple cell's children, ``styles`` inherited from the tags around them."""
    parts: list[str] = []
    for child in node.children:
        if isinstance(child, NavigableString):  # comments too, as official reads them
            parts.append(_styled(_escape_cell_text(str(child)), styles))
            continue
        if not isinstance(child, Tag):
            continue
        inner = _with_style(styles, child.name)
        if child.name == "br":
            parts.append("<br>")
        elif child.name == "code":
            parts.append(_code_span(child.get_text()))
        elif child.name == "eq":
            latex = html.unescape(child.get_text()).strip()
            latex = _FORMULA_PIPE.sub(
                lambda m: "\\" * (2 * len(m.group(1)) + 1) + "|", latex
            )  # GFM keeps n backslashes
            parts.append(f"${latex}$" if latex else "")
        elif child.name == "a" and str(child.get("href", "")).strip():
            href, label = str(child.get("href", "")).strip(), _inline(child, inner)
            if _needs_html(child, styles):
                parts.append(f'<a href="{html.escape(href, quote=True)}">{label}</a>')
            else:
                parts.append(f"[{label}]({_escape_link_target(href)})")
        else:  # p, span, the style tags, a link without a target: their content
            parts.append(_inline(child, inner))
    return "".join(parts)


def _needs_html(node: Tag, styles: tuple[str, ...]) -> bool:
    """Whether some text under ``node`` has a style set without a Markdown marker (a link around
    it is then written as HTML: Markdown cannot nest those tags inside ``[..](..)``)."""
    for child in node.children:
        if isinstance(child, NavigableString):
            if str(child) and styles and frozenset(styles) not in _MARKERS:
                return True
        elif isinstance(child, Tag) and _needs_html(child, _with_style(styles, child.name)):
            return True
    return False


def _styled(text: str, styles: Iterable[str]) -> str:
    """Escaped cell text in its styles: a Markdown marker for a style set that has one, else HTML
    tags (superscript or subscript innermost, then underline, bold, italic, strikethrough);
    spaces and tabs at either end stay outside; blank text is left as it is."""
    styles = tuple(styles)
    core = text.strip(" \t")
    if not text or not styles or not core:
        return text
    leading, trailing = text[: len(text) - len(text.lstrip(" \t"))], text[len(text.rstrip(" \t")) :]
    marker = _MARKERS.get(frozenset(styles))
    if marker is not None:
        return f"{leading}{marker}{core}{marker}{trailing}"
    if "superscript" in styles:
        core = f"<sup>{core}</sup>"
    elif "subscript" in styles:
        core = f"<sub>{core}</sub>"
    for style, tag in (("underline", "u"), ("bold", "strong"), ("italic", "em"), ("strikethrough", "s")):
        if style in styles:
            core = f"<{tag}>{core}</{tag}>"
    return f"{leading}{core}{trailing}"


def _code_span(code: str) -> str:
    """A code span fenced by one backtick more than its longest backtick run, its text escaped as cell text."""
    fence = "`" * (max((len(m.group(0)) for m in re.finditer(r"`+", code)), default=0) + 1)
    return f"{fence}{_escape_cell_text(code)}{fence}"


def _escape_link_target(url: str) -> str:
    """A link target safe inside a pipe table: backslash, space, parentheses and ``|`` percent-encoded."""
    for char, code in (("\\", "%5C"), (" ", "%20"), ("(", "%28"), (")", "%29"), ("|", "%7C")):
        url = url.replace(char, code)
    return url


def _escape_cell_text(text: str) -> str:
    """Cell text made inert: ``&`` and ``<`` as references, backslashes doubled, ``|`` escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("\\", "\\\\").replace("|", r"\|")


def _normalize_cell(text: str) -> str:
    """Whitespace runs as one space, line breaks as spaces, ``<br>`` without spaces around it."""
    text = re.sub(r"[ \t\r\f\v]+", " ", text)
    text = re.sub(r" *\n+ *", " ", text)
    return re.sub(r" *<br> *", "<br>", text).strip()
