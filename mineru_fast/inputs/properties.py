"""What a source document declares about itself, and its pages' geometry, as MinerU 4 records them.

MinerU 4's result files carry two document-level parts that come from the source, not from the
model: ``metadata.document`` (the document's properties: title, authors, dates, ... and its page
count) and ``extensions.docvortex_layout`` (each page's size in points, which DocVortex's
original-layout PDF renderer needs). Both are written by DocVortex 0.6.4 (``document.pdf.metadata.
read_pdf_properties``, ``document.properties``, ``document.pdf.layout.extract_layout_geometry``);
this module reads the same facts with the same rules, so that mineru-fast's files hold the same
values:

- Properties: the PDF's information dictionary first (through PDFium), then its catalog's ``/Lang``
  and, for what is still missing, its XMP packet (through pypdf). Text is stripped of surrounding
  white space and NUL characters, lists keep the first of equal values, dates are ISO 8601 at the
  precision declared (``D:20240102030405+01'00'`` -> ``2024-01-02T03:04:05+01:00``; ``D:2024`` ->
  ``2024``); a value that cannot be read is left out, never guessed. An image has no properties.
- Geometry: a PDF page's visible box (PDFium's bounding box, the crop box within the media box)
  as PDFium reports it (single-precision values), width and height swapped on a page rotated by 90
  or 270 degrees. An image is a page of a PDF it is saved into at 200 dots per inch (DocVortex's
  ``PDFDocument.from_image``, after EXIF orientation): ``pixels * 72 / 200`` points, rounded to
  single precision as PDFium reads the page box back.

Everything here reads headers and dictionaries only: no page is rendered.
"""

from __future__ import annotations

import io
import logging
import re
import struct
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

from PIL import Image

__all__ = [
    "IMAGE_DPI",
    "PROPERTY_FIELDS",
    "image_page_points",
    "pdf_page_points",
    "pdf_properties",
    "property_date",
    "property_text",
    "property_values",
]

IMAGE_DPI = 200
"""Dots per inch of the PDF DocVortex 0.6.4 saves an image into (``DEFAULT_RENDER_DPI``)."""

PROPERTY_FIELDS = (
    "title", "authors", "subject", "keywords", "description", "languages", "identifiers", "publisher",
    "created_at", "modified_at", "creator_application", "producer_application",
)  # fmt: skip
"""The declared properties in ``metadata.document``'s order (DocVortex's ``DocumentProperties``,
before ``page_count`` and ``page_count_kind``); ``authors``, ``keywords``, ``languages`` and
``identifiers`` are lists, the others strings."""

_LISTS = {"authors", "keywords", "languages", "identifiers"}
_INFO_KEYS = {
    "title": "Title", "authors": "Author", "subject": "Subject", "keywords": "Keywords",
    "created_at": "CreationDate", "modified_at": "ModDate", "creator_application": "Creator",
    "producer_application": "Producer",
}  # fmt: skip
# field -> pypdf XmpInformation attribute, in the order DocVortex fills them.
_XMP_FIELDS = {
    "title": "dc_title", "authors": "dc_creator", "subject": "dc_subject", "keywords": "pdf_keywords",
    "description": "dc_description", "languages": "dc_language", "identifiers": "dc_identifier",
    "publisher": "dc_publisher", "creator_application": "xmp_creator_tool", "producer_application": "pdf_producer",
}  # fmt: skip
_XMP_DATES = {"created_at": "CreateDate", "modified_at": "ModifyDate"}
_XMP_BASIC = "{http://ns.adobe.com/xap/1.0/}"
_PDF_DATE = re.compile(r"D:(\d{4})(\d{2})?(\d{2})?(\d{2})?(\d{2})?(\d{2})?(Z|[+-]\d{2}'?(?:\d{2}'?)?)?")
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}  # transposed, rotated 90 or 270 degrees (EXIF 2.32, tag 274)


def property_text(value: object) -> str | None:
    """A declared text value: ``value`` stripped of surrounding white space, then of NUL
    characters; bytes are read as UTF-8 (invalid bytes replaced). None for an empty value and
    for anything that is not text (a number, a container)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None
    return value.strip().replace("\x00", "") or None


def property_values(value: object) -> list[str]:
    """A declared value as a list of texts (a list or tuple item by item, anything else as one
    item), empty ones dropped and repeated ones kept once, in order. A string is never split
    (``"Ann; Bob"`` stays one author)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return list(dict.fromkeys(text for item in items if (text := property_text(item))))


def property_date(value: object, warnings: list[str] | None = None) -> str | None:
    """A declared date as ISO 8601 text at the precision declared, or None.

    Args:
        value: a PDF date (``D:YYYY[MM[DD[HH[mm[SS]]]]][Z|+HH'mm'|-HH'mm']``), ISO 8601 text, or
            a ``date`` / ``datetime``.
        warnings: where a malformed date is reported (``"Invalid declared date: ..."``); it is
            then left out.

    Returns:
        ``"2024"``, ``"2024-01"``, ``"2024-01-02"`` or ``"2024-01-02T03:04:05+01:00"`` (a zone
        only where one was declared: a missing one is not made UTC).
    """
    if isinstance(value, (date, datetime)):
        return value.isoformat()
    text = property_text(value)
    if text is None:
        return None
    if text.startswith("D:"):
        match = _PDF_DATE.fullmatch(text)
        if match is None:
            _invalid_date(text, warnings)
            return None
        year, month, day, hour, minute, second, zone = match.groups()
        text = year
        for separator, part in (("-", month), ("-", day), ("T", hour), (":", minute), (":", second)):
            if part is not None:
                text += separator + part
        if zone:
            zone = zone.replace("'", "")
            text += zone if zone == "Z" else zone[:3] + ":" + (zone[3:] or "00")
    try:
        if re.fullmatch(r"\d{4}", text):
            date(int(text), 1, 1)
        elif re.fullmatch(r"\d{4}-\d{2}", text):
            date(int(text[:4]), int(text[5:]), 1)
        elif "T" in text:
            datetime.fromisoformat(text.replace("Z", "+00:00"))
        else:
            date.fromisoformat(text)
    except ValueError:
        _invalid_date(text, warnings)
        return None
    return text


def _invalid_date(text: str, warnings: list[str] | None) -> None:
    if warnings is not None:
        warnings.append(f"Invalid declared date: {text[:120]}")


def pdf_properties(info: Mapping[str, object], data: bytes) -> tuple[dict[str, Any], list[str]]:
    """The properties a PDF declares, as ``metadata.document`` holds them before its page count.

    Args:
        info: the PDF's information dictionary without the slashes (``Title``, ``Author``, ...,
            ``CreationDate``; PDFium's ``PdfDocument.get_metadata_dict()``).
        data: the PDF's bytes (read with pypdf for the catalog's ``/Lang`` and the XMP packet).

    Returns:
        ``(properties, warnings)``: the fields of ``PROPERTY_FIELDS`` that have a value, in that
        order, and what could not be read (a malformed date, a broken XMP packet), one line each.
        Nothing raises: a property that cannot be read is left out.
    """
    warnings: list[str] = []
    found: dict[str, Any] = {}
    for name, key in _INFO_KEYS.items():
        raw = info.get(key)
        if name in _LISTS:
            found[name] = property_values(raw)
        else:
            found[name] = property_date(raw, warnings) if name.endswith("_at") else property_text(raw)
    try:
        _catalog_properties(data, found, warnings)
    except Exception as exc:  # pypdf and the XML parser raise many types on a malformed file
        warnings.append(f"PDF XMP: {exc}")
    return {name: found[name] for name in PROPERTY_FIELDS if found.get(name)}, warnings


def _catalog_properties(data: bytes, found: dict[str, Any], warnings: list[str]) -> None:
    """``/Lang`` and what is still missing from the XMP packet, read with pypdf into ``found``."""
    from pypdf import PdfReader
    from pypdf.generic import DictionaryObject

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a damaged file is reported here, once
    reader = PdfReader(io.BytesIO(data), strict=False)
    catalog = reader.trailer["/Root"]
    if isinstance(catalog, DictionaryObject):
        found["languages"] = property_values(catalog.get("/Lang"))
    xmp = reader.xmp_metadata
    if xmp is None:
        return
    for name, attribute in _XMP_FIELDS.items():
        if found.get(name):
            continue
        try:
            value = getattr(xmp, attribute, None)
            if isinstance(value, dict):  # a language alternative: the default, else the first
                value = value.get("x-default") or next(iter(value.values()), None)
            values = property_values(value)
            if name == "keywords" and not values:
                values = property_values(xmp.dc_subject)
            found[name] = values if name in _LISTS else (values[0] if values else None)
        except Exception as exc:
            warnings.append(f"PDF XMP {attribute}: {exc}")
    # Dates from the packet's text as written (a date without a zone stays without one).
    root = ElementTree.fromstring(xmp.stream.get_data())
    for name, tag in _XMP_DATES.items():
        if found.get(name):
            continue
        for element in root.iter():
            value = element.text if element.tag == _XMP_BASIC + tag else element.get(_XMP_BASIC + tag)
            if normalized := property_date(value, warnings):
                found[name] = normalized
                break


def pdf_page_points(pdf: Any, index: int) -> tuple[float, float]:
    """``(width, height)`` of page ``index`` in points, as it is displayed.

    Args:
        pdf: the open ``pypdfium2.PdfDocument`` (the caller holds the PDFium lock).
        index: 0-based page index.

    Raises:
        ValueError: the box is not finite and positive. PDFium's own error when the page cannot
            be loaded.
    """
    page = pdf[index]
    try:
        left, bottom, right, top = page.get_bbox()
        try:
            rotation = int(page.get_rotation()) % 360
        except Exception:  # an unreadable /Rotate counts as none, as DocVortex reads it
            rotation = 0
    finally:
        page.close()
    width, height = abs(right - left), abs(bottom - top)
    if not all(0 < value < float("inf") for value in (width, height)):
        raise ValueError(f"page {index + 1} has no visible area ({width} x {height} points)")
    return (height, width) if rotation in (90, 270) else (width, height)


def _single(value: float) -> float:
    """``value`` rounded to IEEE single precision (PDFium's ``float``)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def image_page_points(image: Image.Image) -> tuple[float, float]:
    """``(width, height)`` in points of the page an image (its current frame) makes: its size
    after EXIF orientation at ``IMAGE_DPI``, in single precision. Reads the header only."""
    width, height = image.size
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    except Exception:  # a damaged EXIF block: Pillow's exif_transpose leaves such an image as it is
        orientation = None
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return _single(width * 72.0 / IMAGE_DPI), _single(height * 72.0 / IMAGE_DPI)
