"""What produced a parse result: the metadata block of ``Document.to_dict()`` / ``<stem>.json``.

The block records the result schema version, the input (SHA-256 of its bytes, format, page count,
pages parsed), the model (hub id, revision, commit, protocol version), the parser options, the
package version, the tier and the runtime choices (ISA class, precision, INT8 kernel and why, see
``engine.numerics.describe``). The whole result validates against ``schema/document.schema.json``, shipped
with the package (``SCHEMA_PATH``, ``load_schema``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mineru_fast._version import __version__
from mineru_fast.errors import CorruptDocument

if TYPE_CHECKING:
    from mineru_fast.results.page import ParseError

log = logging.getLogger(__name__)

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "PACKAGE", "InputInfo", "head_dict", "load_schema"]

SCHEMA_VERSION = "1.2"  # 1.1: input.warnings; 1.2: input.properties, input.page_geometry
"""Version of the result layout (``schema/document.schema.json``): the major part changes when a
field is removed or changes meaning, the minor part when fields are added."""

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schema" / "document.schema.json"
PACKAGE = {"name": "mineru-fast", "version": __version__}  # the result's ``metadata.package``


@dataclass(frozen=True)
class InputInfo:
    """The input document of a result.

    Attributes:
        name: file stem, or ``"document"`` for in-memory sources.
        format: ``"pdf"``, the Pillow format name (``"PNG"``, ``"TIFF"``, ...), or ``"images"`` for a
            list of PIL images.
        sha256: hex SHA-256 of the input bytes; None for in-memory images (no bytes).
        page_count: pages (frames) in the whole document.
        pages: 0-based indices of the pages parsed.
        warnings: what opening it changed or left out (a page range clamped to the document, the
            frames of an animation after the first), one line each.
        properties: what the document declares about itself (title, authors, dates, ...; only the
            fields that have a value, ``inputs.properties.PROPERTY_FIELDS``): MinerU 4's
            ``metadata.document`` before its page count. Empty for an image.
        page_geometry: per page parsed, ``{"page_idx", "width_pt", "height_pt"}``: its size in
            points as MinerU 4's ``extensions.docvortex_layout`` records it (a page whose size
            cannot be read is left out, as there).
    """

    name: str
    format: str
    sha256: str | None
    page_count: int
    pages: tuple[int, ...]
    warnings: tuple[str, ...] = ()
    properties: dict[str, Any] = field(default_factory=dict)
    page_geometry: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_opened(cls, opened: Any) -> InputInfo:
        """From an ``inputs.OpenedDocument`` (or anything with its attributes; its ``properties``
        and ``page_points`` methods, where it has them, give the source's properties and geometry,
        read from headers and dictionaries only)."""
        properties: dict[str, Any] = {}
        geometry: list[dict[str, Any]] = []
        if hasattr(opened, "properties"):
            properties, problems = opened.properties()
            for problem in problems:
                log.info("%s: document properties: %s", opened.name, problem)
            for index in opened.page_indices:
                try:
                    width, height = opened.page_points(index)
                except CorruptDocument as exc:  # the page fails again, alone, when it is rendered
                    log.warning("%s: no page geometry for page %d: %s", opened.name, index + 1, exc)
                    continue
                geometry.append({"page_idx": index, "width_pt": width, "height_pt": height})
        return cls(
            opened.name,
            opened.format,
            getattr(opened, "sha256", None),
            opened.page_count,
            tuple(opened.page_indices),
            tuple(getattr(opened, "warnings", ())),
            properties,
            tuple(geometry),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": self.format,
            "sha256": self.sha256,
            "page_count": self.page_count,
            "pages": list(self.pages),
            "warnings": list(self.warnings),
            "properties": dict(self.properties),
            "page_geometry": [dict(page) for page in self.page_geometry],
        }


def head_dict(
    name: str,
    status: str,
    metadata: dict[str, Any] | None,
    errors: Sequence[ParseError],
    timings: dict[str, float],
    counts: dict[str, int],
) -> dict[str, Any]:
    """The document-level part of a result (everything but ``pages``), in the schema's key order.
    Without ``metadata`` the block holds the schema and package versions only."""
    if metadata is None:
        metadata = {"schema_version": SCHEMA_VERSION, "package": dict(PACKAGE)}
    return {
        "name": name,
        "status": status,
        "metadata": metadata,
        "errors": [e.to_dict() for e in errors],
        "timings": timings,
        "counts": counts,
    }


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``Document.to_dict()`` and ``<stem>.json``."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
