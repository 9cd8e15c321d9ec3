"""What produced a parse result: the metadata block of ``Document.to_dict()`` / ``<stem>.json``.

The block records the result schema version, the input (SHA-256 of its bytes, format, page count,
pages parsed), the model (hub id, revision, commit, protocol version), the parser options, the
package version, the tier and the runtime choices (ISA class, precision, INT8 kernel and why, see
``engine.numerics.describe``). The whole result validates against ``schema/document.schema.json``, shipped
with the package (``SCHEMA_PATH``, ``load_schema``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mineru_fast._version import __version__

if TYPE_CHECKING:
    from mineru_fast.results.page import ParseError

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "PACKAGE", "InputInfo", "head_dict", "load_schema"]

SCHEMA_VERSION = "1.1"  # 1.1: input.warnings
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
    """

    name: str
    format: str
    sha256: str | None
    page_count: int
    pages: tuple[int, ...]
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_opened(cls, opened: Any) -> InputInfo:
        """From an ``inputs.OpenedDocument`` (or anything with its attributes)."""
        return cls(
            opened.name,
            opened.format,
            getattr(opened, "sha256", None),
            opened.page_count,
            tuple(opened.page_indices),
            tuple(getattr(opened, "warnings", ())),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": self.format,
            "sha256": self.sha256,
            "page_count": self.page_count,
            "pages": list(self.pages),
            "warnings": list(self.warnings),
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
