"""The text inside one block, built from the page's PDF characters the way MinerU 4 builds it.

Rules and constants are MinerU 4.0.12's where it states them (``backend/analysis/pdf/text/
native.py`` and DocVortex's ``merge_text_line_contents``):

- a character belongs to the block when the centre of its box lies inside the block;
- characters of an inline-formula region are left out, the region itself takes their place
  (``\\(latex\\)`` once recognized, see ``FORMULA``);
- within a line, a space is inserted where the gap to the next character exceeds a quarter of the
  block's median character width (not next to a space, not between two CJK characters, where
  PDFium's generated spaces are dropped too);
- ligatures ﬁ ﬂ ﬀ ﬃ ﬄ ﬅ ﬆ become their letters, ``\\x02`` (PDFium's line-end hyphen) becomes
  ``-``, a spacing diacritic overlapping a letter by half on both axes is composed with it (NFC);
- runs of smaller characters (box height <= 0.8 of the line's body text) raised or lowered from
  the body are wrapped in ``<sup>``/``<sub>`` (MinerU marks superscripts and subscripts with these
  tags; its geometric classifier is not published in the sources read, this rule is this
  package's);
- lines are joined: an English word broken by a line-end hyphen before a lower-case letter is
  rejoined (not for all-capital words like GLGE- or the compound prefixes open-, non-, self-,
  cross-, anti-, pre-, post-, co-, semi-, multi-, quasi-), other hyphens and digit ranges join
  without a space, a URL running over the line end joins without a space, CJK text and
  brackets/closing punctuation join without a space, everything else with one space.

Lines are found geometrically for horizontal text (characters sharing a vertical band, left to
right); text on a rotated baseline keeps PDFium's content order and its line breaks.
"""

from __future__ import annotations

import math
import re
import statistics
import unicodedata
from collections.abc import Container, Sequence
from dataclasses import dataclass

from mineru_fast.inputs.pdftext.chars import PageText, PdfChar

__all__ = ["BlockText", "block_text", "merge_lines", "FORMULA", "PRIVATE_USE_SUSPICIOUS"]

Box = tuple[float, float, float, float]

# Placeholder of the k-th inline formula inside assembled text: "\(" + NUL k NUL + "\)". Its
# visible boundary characters are those of the final "\(latex\)", so line joining decides the
# same spaces as for the recognized formula; NUL is a control character the joining rules skip.
FORMULA = re.compile(r"\\\(\x00(\d+)\x00\\\)")

_LIGATURES = {"ﬁ": "fi", "ﬂ": "fl", "ﬀ": "ff", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "ft", "ﬆ": "st"}
_SPACING_DIACRITICS = {
    "`": "\u0300", "^": "\u0302", "¨": "\u0308", "¯": "\u0304", "´": "\u0301", "¸": "\u0327",
    "ˆ": "\u0302", "ˇ": "\u030c", "˘": "\u0306", "˙": "\u0307", "˚": "\u030a", "˛": "\u0328",
    "˜": "\u0303", "˝": "\u030b",
}  # fmt: skip
_UNSPACED = (
    (0x3000, 0x303F), (0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF), (0xFF61, 0xFF9F), (0x1AFF0, 0x1AFFF), (0x1B000, 0x1B16F), (0x20000, 0x2EE5F),
    (0x2F800, 0x2FA1F), (0x30000, 0x323AF),
)  # fmt: skip
_CJK_PUNCTUATION = frozenset("，。！？；：、（）【】《》〈〉「」『』〔〕［］｛｝")
_CLOSING = frozenset(",.;:!?%")
_HYPHENS = "-\u00ad\u2010\u2011\u2043"
_COMPOUND_PREFIXES = frozenset({"open", "non", "self", "cross", "anti", "pre", "post", "co", "semi", "multi", "quasi"})
_COMPOUND_CONNECTORS = frozenset({"of", "the", "to", "and", "in", "for", "on", "by", "with"})
_URL = re.compile(r"(?<![A-Za-z0-9])(?:(?:https?|ftp)://|www\.)[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]+", re.I | re.A)
_URL_START = re.compile(r"(?:(?:https?|ftp)://|www\.)", re.I | re.A)
_STYLE_TAG = re.compile(r"</?(?:sup|sub|b|strong|i|em|u|s|del|strike)\b[^>]*>", re.I)
_SCRIPT_SIZE = 0.8  # a character this much smaller than the line's body text may be a script
_SCRIPT_SHIFT = 0.1  # ... when its centre is off the body's centre by this share of the body height
PRIVATE_USE_SUSPICIOUS = (2, 2, 0.05)  # MinerU: >= 2 private-use chars and a run of 2 or 5 % of the text
JOIN_CONTEXT = 1024  # characters before a line end that joining looks at (a URL over a line end: less)
MAX_LINE_CHECKS = 32  # line checks per character of a block (born-digital pages: 1 to 6; see ``block_text``)


@dataclass(frozen=True)
class BlockText:
    """The text of one block as assembled from the PDF.

    Attributes:
        text: the block's text; inline formulas appear as ``FORMULA`` placeholders.
        formulas: indices (into the formula boxes given) of the formulas placed in ``text``.
        chars: characters taken from the PDF (whitespace excluded).
        used: indices (into ``PageText.chars``) of the characters the block took, whitespace and
            characters covered by its formulas included.
        suspicious: the characters cannot be trusted (private-use runs as MinerU detects them,
            or 3 % or more NUL, U+FFFD, control or unmapped characters): read the block from
            its image instead.
    """

    text: str
    formulas: tuple[int, ...]
    chars: int
    suspicious: bool
    used: tuple[int, ...] = ()


def _center(box: Box) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def _inside(point: tuple[float, float], box: Box) -> bool:
    return box[0] <= point[0] <= box[2] and box[1] <= point[1] <= box[3]


def _unspaced(ch: str) -> bool:
    return ch in _CJK_PUNCTUATION or any(lo <= ord(ch) <= hi for lo, hi in _UNSPACED)


def _overlap(a: Box, b: Box, axis: int) -> float:
    lo, hi = axis, axis + 2
    smaller = min(a[hi] - a[lo], b[hi] - b[lo])
    return max(0.0, min(a[hi], b[hi]) - max(a[lo], b[lo])) / smaller if smaller > 0 else 0.0


def _compose_diacritics(chars: list[PdfChar]) -> list[PdfChar]:
    out: list[PdfChar] = []
    i = 0
    while i < len(chars):
        cur, nxt = chars[i], chars[i + 1] if i + 1 < len(chars) else None
        if nxt is not None:
            base, mark = (nxt, cur) if cur.text in _SPACING_DIACRITICS else (cur, nxt)
            combining = _SPACING_DIACRITICS.get(mark.text)
            if (
                combining
                and len(base.text) == 1
                and unicodedata.category(base.text).startswith("L")
                and _overlap(base.bbox, mark.bbox, 0) >= 0.5
                and _overlap(base.bbox, mark.bbox, 1) >= 0.5
            ):
                composed = unicodedata.normalize("NFC", base.text + combining)
                if len(composed) == 1 and composed != base.text:
                    out.append(PdfChar(composed, base.bbox, base.generated, base.map_error, base.angle))
                    i += 2
                    continue
        out.append(cur)
        i += 1
    return out


@dataclass
class _Item:
    """A character or an inline formula inside a line."""

    text: str
    bbox: Box
    role: str = "body"  # "body", "sup", "sub"; formulas are always body
    generated: bool = False


def _vertical_overlap(a: Box, b: Box) -> float:
    smaller = min(a[3] - a[1], b[3] - b[1])
    return max(0.0, min(a[3], b[3]) - max(a[1], b[1])) / smaller if smaller > 0 else 0.0


class _Reach:
    """How far down each line band's reference box reaches (its bottom y), by band creation
    index, kept as a max-tree: the next band at or after an index that reaches below a given y is
    found in O(log bands), however tall the page's other items are."""

    def __init__(self, capacity: int) -> None:
        self._size = 1 << max(capacity - 1, 0).bit_length()
        self._max = [-math.inf] * (2 * self._size)

    def set(self, band: int, bottom: float) -> None:
        i = band + self._size
        self._max[i] = bottom if bottom > -math.inf else -math.inf  # NaN: reaches nothing
        while i > 1:
            i >>= 1
            reach = max(self._max[2 * i], self._max[2 * i + 1])
            if self._max[i] == reach:  # nothing above changes either
                return
            self._max[i] = reach

    def next_below(self, start: int, y: float) -> int | None:
        """The first band ``>= start`` whose reference box reaches below ``y``, or None."""
        if start >= self._size:
            return None
        tree, i = self._max, start + self._size
        while not tree[i] > y:  # on to the next subtree to the right
            while i & 1:
                i >>= 1
            if i == 0:
                return None
            i += 1
        while i < self._size:
            i = 2 * i if tree[2 * i] > y else 2 * i + 1
        return i - self._size


def _lines(items: list[_Item], horizontal: bool, budget: int) -> list[list[_Item]] | None:
    """Group items into lines: horizontal text by vertical overlap (an item joins the line whose
    tallest item it overlaps by half its height or more), other text by PDFium's line breaks.

    Returns None when horizontal grouping would compare items with lines more than ``budget``
    times (boxes laid out against the sweep below, see ``MAX_LINE_CHECKS``)."""
    if not horizontal:
        lines: list[list[_Item]] = [[]]
        for item in items:
            if item.generated and item.text in ("\r", "\n"):
                if lines[-1]:
                    lines.append([])
            else:
                lines[-1].append(item)
        return [line for line in lines if line]
    # An interval sweep: items come in order of their centre's y, so every band's reference box
    # has its centre at or above the item's, and only bands whose box reaches below the item's own
    # top can overlap it; those are visited in creation order (``_Reach``), the others never (one
    # tall glyph no longer keeps every band of the page in reach). An overlap is at most 1: the
    # first band reaching it is the first best among all bands, as the others overlap 0.
    rows = sorted((i for i in items if i.text not in ("\r", "\n")), key=lambda i: _center(i.bbox)[1])
    bands: list[tuple[Box, list[_Item]]] = []  # (box of the tallest member, members)
    reach = _Reach(len(rows))
    for item in rows:
        top, best, best_overlap = item.bbox[1], None, 0.0
        k = reach.next_below(0, top)
        while k is not None:
            budget -= 1
            if budget < 0:
                return None
            overlap = _vertical_overlap(bands[k][0], item.bbox)
            if best is None or overlap > best_overlap:
                best, best_overlap = k, overlap
            if overlap == 1.0:
                break
            k = reach.next_below(k + 1, top)
        if best is not None and best_overlap >= 0.5:
            ref, members = bands[best]
            members.append(item)
            if item.bbox[3] - item.bbox[1] > ref[3] - ref[1]:
                bands[best] = (item.bbox, members)
                reach.set(best, item.bbox[3])
        else:
            reach.set(len(bands), item.bbox[3])
            bands.append((item.bbox, [item]))
    bands.sort(key=lambda band: _center(band[0])[1])
    return [sorted(members, key=lambda i: i.bbox[0]) for _, members in bands]


def _mark_scripts(line: list[_Item]) -> None:
    """Mark raised/lowered runs of smaller characters; the body size is the line's median."""
    heights = [i.bbox[3] - i.bbox[1] for i in line if i.text.strip() and FORMULA.fullmatch(i.text) is None]
    if not heights:
        return
    body = statistics.median(heights)
    body_items = [i for i in line if i.text.strip() and abs((i.bbox[3] - i.bbox[1]) - body) <= 0.2 * body]
    if not body_items:
        return
    body_center = statistics.median(_center(i.bbox)[1] for i in body_items)
    for item in line:
        height = item.bbox[3] - item.bbox[1]
        if item.text.strip() and FORMULA.fullmatch(item.text) is None and height <= _SCRIPT_SIZE * body:
            shift = _center(item.bbox)[1] - body_center
            if abs(shift) > _SCRIPT_SHIFT * body:
                item.role = "sup" if shift < 0 else "sub"


def _line_text(line: list[_Item], median_width: float) -> str:
    parts: list[tuple[str, str]] = []  # (role, text)
    for k, item in enumerate(line):
        prev = line[k - 1] if k else None
        nxt = line[k + 1] if k + 1 < len(line) else None
        if item.text == " " and item.generated and prev and nxt and _unspaced(prev.text[-1]) and _unspaced(nxt.text[0]):
            continue
        if prev is not None and parts and parts[-1][1] != " " and item.text != " ":
            gap = item.bbox[0] - prev.bbox[2]
            both_cjk = _unspaced(prev.text[-1]) and _unspaced(item.text[0])
            formula = FORMULA.fullmatch(item.text) or FORMULA.fullmatch(prev.text)
            if formula or (gap > 0.25 * median_width and not both_cjk):
                parts.append((prev.role if prev.role == item.role else "body", " "))
        parts.append((item.role, item.text))
    out: list[str] = []
    for role, group in _runs(parts):
        text = "".join(group)
        out.append(text if role == "body" else f"<{role}>{text}</{role}>")
    return "".join(out).strip()


def _runs(parts: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    runs: list[tuple[str, list[str]]] = []
    for role, text in parts:
        if runs and runs[-1][0] == role:
            runs[-1][1].append(text)
        else:
            runs.append((role, [text]))
    return runs


def _clean(text: str) -> str:
    text = text.replace("\r\n", "").replace("\x02", "-")
    return re.sub("|".join(map(re.escape, _LIGATURES)), lambda m: _LIGATURES[m.group()], text)


def _boundary(text: str, from_end: bool) -> str:
    visible = _STYLE_TAG.sub("", text).strip()
    chars = reversed(visible) if from_end else iter(visible)
    return next((c for c in chars if unicodedata.category(c)[0] not in "MC"), "")


def _join(previous: str, following: str) -> tuple[bool, str]:
    """Whether the previous text's line-end hyphen goes, and the separator before the next line.

    ``previous`` may be the last ``JOIN_CONTEXT`` characters of the text joined so far: every rule
    looks at its end only."""
    if _url_across(previous, following):
        return False, " " if _URL_START.match(following) else ""
    word, start = "", len(previous) - 1  # a line-end hyphen after a run of ASCII letters: the word
    if previous[-1] in _HYPHENS:
        while start > 0 and previous[start - 1].isascii() and previous[start - 1].isalpha():
            start -= 1
        word = previous[start:-1]
    if word:
        acronym = len(word) > 1 and word.isupper()
        compound = previous.endswith("-") and (
            word.lower() in _COMPOUND_PREFIXES
            or (word.lower() in _COMPOUND_CONNECTORS and start > 0 and previous[start - 1] == "-")
        )
        return following[0].islower() and not acronym and not compound, ""
    if re.search(r"\d[-–]$", previous) and following[0].isdigit():
        return False, ""
    last, first = _boundary(previous, True), _boundary(following, False)
    if not last or not first or _unspaced(last) or _unspaced(first):
        return False, ""
    if unicodedata.category(last) in ("Ps", "Pi") or unicodedata.category(first) in ("Pe", "Pf") or first in _CLOSING:
        return False, ""
    return False, " "


def _url_across(previous: str, following: str) -> bool:
    joined = previous + following
    return any(m.start() < len(previous) < m.end() for m in _URL.finditer(joined))


def merge_lines(lines: Sequence[str]) -> str:
    """Join a block's lines into one text (MinerU's line-joining rules, see the module docstring).

    Each join looks at the last ``JOIN_CONTEXT`` characters joined so far, so the time is linear in
    the characters (it was quadratic: a 39 KB block took minutes)."""
    cleaned = [line.strip() for line in lines if line.strip()]
    if not cleaned:
        return ""
    parts, tail = [cleaned[0]], cleaned[0][-JOIN_CONTEXT:]
    for line in cleaned[1:]:
        drop_hyphen, separator = _join(tail, line)
        if drop_hyphen:
            parts[-1], tail = parts[-1][:-1], tail[:-1]
        parts += [separator, line]
        tail = (tail + separator + line)[-JOIN_CONTEXT:]
    return "".join(parts).strip()


def _suspicious(chars: list[PdfChar]) -> bool:
    counted = [c for c in chars if not c.text.isspace()]
    if not counted:
        return False
    pua = [0xE000 <= ord(c.text[0]) <= 0xF8FF for c in counted]
    run = longest = 0
    for flag in pua:
        run = run + 1 if flag else 0
        longest = max(longest, run)
    count = sum(pua)
    min_count, min_run, min_ratio = PRIVATE_USE_SUSPICIOUS
    if count >= min_count and (longest >= min_run or count / len(counted) >= min_ratio):
        return True
    bad = sum(
        c.map_error or c.text in ("\x00", "\ufffd") or (unicodedata.category(c.text[0]) == "Cc" and c.text != "\x02")
        for c in counted
    )  # "\x02" is PDFium's line-end hyphen
    return bad / len(counted) >= 0.03


def _near(angle: int, target: int, tolerance: int = 30) -> bool:
    return abs((angle - target + 180) % 360 - 180) <= tolerance


def block_text(page: PageText, bbox: Box, formulas: Sequence[Box | None] = (), skip: Container[int] = ()) -> BlockText:
    """Assemble the text of the block at ``bbox`` from the page's characters.

    Args:
        page: the page's text layer (``read_page_text``).
        bbox: the block, normalized to the displayed page.
        formulas: inline-formula regions on the page (normalized; None entries are ignored); in a
            block of horizontal text, those lying more than half inside the block are placed in
            its text as ``FORMULA`` placeholders and their characters left out.
        skip: indices of characters already taken by earlier blocks (MinerU gives each piece of
            text to the first block in reading order that holds it).

    Returns:
        The assembled text and whether it can be trusted. Characters whose baseline is more than
        30 degrees off the block's dominant direction (watermarks, rotated labels) are left out,
        and so are hidden ones (``PdfChar.hidden``: invisible or clip-only text). A block holding
        white text (``PdfChar.white``: hidden on a white page, or the words of a dark banner) is
        ``suspicious``: read from its image, neither trusted nor dropped. So is a block whose
        character boxes would take line grouping more than ``MAX_LINE_CHECKS`` checks per
        character (tall boxes stacked against its sweep; born-digital pages take 1 to 6): its
        text is then empty, and the work on any block stays bounded per character.
    """
    indices = [i for i in page.indices_in(bbox) if i not in skip and not page.chars[i].hidden]
    angles = [page.chars[i].angle for i in indices if not page.chars[i].text.isspace()]
    direction = max(set(angles), key=angles.count) if angles else 0
    horizontal = direction == 0
    placed: dict[int, Box] = {}
    if horizontal:
        placed = {k: f for k, f in enumerate(formulas) if f is not None and _area_inside(f, bbox) > 0.5}
    kept, used = [], []
    for i in indices:
        char = page.chars[i]
        if any(_inside(_center(char.bbox), f) for f in placed.values()):
            used.append(i)
        elif char.text.isspace() or _near(char.angle, direction):
            kept.append(char)
            used.append(i)
    visible = [c for c in kept if not c.text.isspace()]
    if not visible and not placed:
        return BlockText("", (), 0, False)
    items = [_Item(c.text, c.bbox, generated=c.generated) for c in _compose_diacritics(kept)]
    items += [_Item(f"\\(\x00{k}\x00\\)", f) for k, f in placed.items()]
    lines = _lines(items, horizontal, MAX_LINE_CHECKS * len(items))
    if lines is None:
        return BlockText("", (), len(visible), True, tuple(used))
    if horizontal:
        for line in lines:
            _mark_scripts(line)
        median_width = statistics.median([c.bbox[2] - c.bbox[0] for c in visible]) if visible else 0.0
    else:  # gaps along a rotated baseline are not measured; PDFium's generated spaces remain
        median_width = float("inf")
    text = merge_lines([_clean(_line_text(line, median_width)) for line in lines])
    in_text = tuple(int(m.group(1)) for m in FORMULA.finditer(text))
    suspicious = _suspicious(visible) or any(c.white for c in visible)
    return BlockText(text, in_text, len(visible), suspicious, tuple(used))


def _area_inside(inner: Box, outer: Box) -> float:
    area = (inner[2] - inner[0]) * (inner[3] - inner[1])
    if area <= 0:
        return 0.0
    w = max(0.0, min(inner[2], outer[2]) - max(inner[0], outer[0]))
    h = max(0.0, min(inner[3], outer[3]) - max(inner[1], outer[1]))
    return w * h / area
