"""An HTML fragment as a small tree, parsed and written back the way mineru 4.0.12 does it.

docvortex 0.6.4 re-serializes a table whose cell text it changes (``content.normalization.
_normalize_table``: ``str(BeautifulSoup(markup, "html.parser"))``). This module reproduces that
round trip with the standard library's ``html.parser`` (the parser BeautifulSoup drives there) and
the behaviour of beautifulsoup4 4.15's tree builder and "minimal" formatter, read from its source:

- character and entity references are decoded (an unknown ``&name;`` stays text, its ``;`` dropped; numeric
  references follow the HTML rule: 0, surrogates and values past U+10FFFF give U+FFFD, 0x80..0x9F
  are read as Windows-1252);
- a run of ASCII whitespace alone becomes one newline (if it held one) or one space, except
  inside ``pre`` / ``textarea``;
- an end tag closes up to the most recent open element of its name (none open: ignored); void
  elements (``br``, ``img``, ...) close at once and their stray end tags are ignored;
- on output, text and attribute values escape ``& < >`` (text inside ``script`` / ``style`` as
  is), attributes are sorted by name, written ``name="value"`` (single quotes when the value holds
  ``"`` but no ``'``; else ``"`` becomes ``&quot;``), multi-valued attributes (``class``, ...)
  with single spaces, an empty void element as ``<br/>``, comments, CDATA, declarations and
  processing instructions with beautifulsoup's delimiters.

Pure Python, no dependency.
"""

from __future__ import annotations

import html.entities
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

__all__ = ["Element", "Text", "parse_fragment", "serialize"]

# beautifulsoup4 4.15 builder/__init__.py, HTMLTreeBuilder.
VOID_ELEMENTS = frozenset(
    "area base br col embed hr img input keygen link menuitem meta param source track wbr "
    "basefont bgsound command frame image isindex nextid spacer".split()
)
_PRESERVE_WHITESPACE = frozenset({"pre", "textarea"})
_STRING_CONTAINERS = {"rt": "ruby_text", "rp": "ruby_parenthesis", "style": "stylesheet", "script": "script"}
_STRING_CONTAINERS["template"] = "template"
_MULTI_VALUED = {
    "*": {"class", "accesskey", "dropzone"},
    "a": {"rel", "rev"},
    "link": {"rel", "rev"},
    "td": {"headers"},
    "th": {"headers"},
    "form": {"accept-charset"},
    "object": {"archive"},
    "area": {"rel"},
    "icon": {"sizes"},
    "iframe": {"sandbox"},
    "output": {"for"},
}
_UNESCAPED_TEXT_PARENTS = frozenset({"script", "style"})  # the formatter's cdata_containing_tags
_ASCII_SPACES = frozenset("\x20\x0a\x09\x0c\x0d")
# Delimiters of the special strings on output (beautifulsoup4 element.py PREFIX / SUFFIX).
_DELIMITERS = {
    "comment": ("<!--", "-->"),
    "cdata": ("<![CDATA[", "]]>"),
    "pi": ("<?", ">"),
    "declaration": ("<?", "?>"),
    "doctype": ("<!DOCTYPE ", ">\n"),
}
# HTML entity names without their semicolon, first spelling wins (as beautifulsoup builds its map).
_ENTITIES: dict[str, str] = {}
for _name, _character in sorted(html.entities.html5.items()):
    _ENTITIES.setdefault(_name.removesuffix(";"), _character)


@dataclass
class Text:
    """A string node.

    Attributes:
        value: its text (references decoded).
        kind: ``"text"`` for character data; ``"comment"``, ``"cdata"``, ``"pi"``,
            ``"declaration"`` or ``"doctype"`` for the special strings.
        container: for character data, ``"plain"``, or the kind of element whose text it is
            (``"ruby_text"`` inside ``rt``, ``"script"``, ...), as beautifulsoup types strings.
    """

    value: str
    kind: str = "text"
    container: str = "plain"


@dataclass
class Element:
    """An element: lower-case ``name``, ``attrs`` in source order (a repeated name keeps its last
    value, in its first position), ``children`` (elements and ``Text``)."""

    name: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Element | Text] = field(default_factory=list)

    def iter(self) -> Iterator[Element]:
        """This element's descendant elements in document order (itself excluded)."""
        for child in self.children:
            if isinstance(child, Element):
                yield child
                yield from child.iter()


def _numeric_reference(name: str) -> tuple[str, str]:
    """``(character, trailing text)`` of a numeric reference body such as ``x27`` or ``39``."""
    base, digits, pattern = (16, name[1:], r"[0-9a-f]+") if name[:1] in "xX" else (10, name, r"[0-9]+")
    try:
        number, rest = int(digits, base), ""
    except ValueError:
        match = re.match(f"({pattern})(.*)", digits)
        if match is None:
            return "", name
        number, rest = int(match.group(1), base), match.group(2)
    if number == 0 or number > 0x10FFFF or 0xD800 <= number <= 0xDFFF:
        return "\ufffd", rest
    if 0x80 <= number <= 0x9F:
        try:
            return bytes([number]).decode("cp1252"), rest
        except UnicodeDecodeError:
            return chr(number), rest
    return chr(number), rest


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.root = Element("[document]")
        self.stack = [self.root]
        self.data: list[str] = []
        self.closed_voids: list[str] = []

    def _end_data(self, kind: str = "text") -> None:
        if not self.data:
            return
        value = "".join(self.data)
        self.data = []
        if not any(e.name in _PRESERVE_WHITESPACE for e in self.stack) and all(c in _ASCII_SPACES for c in value):
            value = "\n" if "\n" in value else " "
        container = "plain"
        if kind == "text":
            for element in reversed(self.stack):
                if element.name in _STRING_CONTAINERS:
                    container = _STRING_CONTAINERS[element.name]
                    break
        self.stack[-1].children.append(Text(value, kind, container))

    def _start(self, tag: str, attrs: list[tuple[str, str | None]]) -> Element:
        self._end_data()
        values: dict[str, str] = {}
        for key, value in attrs:
            values[key] = "" if value is None else value
        for key in (*_MULTI_VALUED["*"], *_MULTI_VALUED.get(tag, ())):
            if key in values:
                values[key] = " ".join(re.findall(r"\S+", values[key]))
        element = Element(tag, values)
        self.stack[-1].children.append(element)
        self.stack.append(element)
        return element

    def _end(self, tag: str) -> None:
        self._end_data()
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].name == tag:
                del self.stack[i:]
                return

    def handle_starttag(self, tag, attrs):
        self._start(tag, attrs)
        if tag in VOID_ELEMENTS:
            self._end(tag)
            self.closed_voids.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._start(tag, attrs)
        self._end(tag)

    def handle_endtag(self, tag):
        if tag in self.closed_voids:
            self.closed_voids.remove(tag)
        else:
            self._end(tag)

    def handle_data(self, data):
        self.data.append(data)

    def handle_charref(self, name):
        character, rest = _numeric_reference(name)
        self.data.extend((character, rest))

    def handle_entityref(self, name):
        self.data.append(_ENTITIES.get(name, f"&{name}"))

    def _special(self, value: str, kind: str) -> None:
        self._end_data()
        self.data.append(value)
        self._end_data(kind)

    def handle_comment(self, data):
        self._special(data, "comment")

    def handle_decl(self, decl):
        self._special(decl[len("DOCTYPE ") :], "doctype")

    def unknown_decl(self, data):
        if data.upper().startswith("CDATA["):
            self._special(data[len("CDATA[") :], "cdata")
        else:
            self._special(data, "declaration")

    def handle_pi(self, data):
        self._special(data, "pi")


def parse_fragment(markup: str) -> Element:
    """Parse an HTML fragment into a tree (see the module docstring for the rules).

    Args:
        markup: any string; malformed markup is read as ``html.parser`` reads it.

    Returns:
        The root element (name ``"[document]"``, written without tags by ``serialize``).
    """
    builder = _Builder()
    builder.feed(markup)
    builder.close()
    builder._end_data()
    return builder.root


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _quoted(value: str) -> str:
    if '"' in value:
        if "'" in value:
            return '"' + value.replace('"', "&quot;") + '"'
        return "'" + value + "'"
    return '"' + value + '"'


def serialize(node: Element | Text, parent: str = "") -> str:
    """The markup of a tree from ``parse_fragment`` as ``str()`` of the BeautifulSoup tree gives it.

    Args:
        node: the root, an element or a string node.
        parent: the name of the string node's parent element (text inside ``script`` / ``style``
            is written unescaped).
    """
    if isinstance(node, Text):
        if node.kind != "text":
            left, right = _DELIMITERS[node.kind]
            return left + node.value + right
        return node.value if parent in _UNESCAPED_TEXT_PARENTS else _escape(node.value)
    inner = "".join(serialize(child, node.name) for child in node.children)
    if node.name == "[document]":
        return inner
    attrs = "".join(f" {key}={_quoted(_escape(value))}" for key, value in sorted(node.attrs.items()))
    if not node.children and node.name in VOID_ELEMENTS:
        return f"<{node.name}{attrs}/>"
    return f"<{node.name}{attrs}>{inner}</{node.name}>"
