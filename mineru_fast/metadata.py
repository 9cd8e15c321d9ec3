"""What produced a parse result: the metadata block of ``Document.to_dict()`` / ``<stem>.json``.

The block records the result schema version, the input (SHA-256 of its bytes, format, page count,
pages parsed), the model (hub id, revision, commit, protocol version), the parser options, the
package version, the tier and the runtime choices (ISA class, precision, INT8 kernel and why, see
``choice.describe``). The whole result validates against ``schema/document.schema.json``, shipped
with the package (``SCHEMA_PATH``, ``load_schema``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .document import ParseError
    from .parser import DocumentParser

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "InputInfo", "result_metadata", "head_dict", "load_schema"]

SCHEMA_VERSION = "1.0"
"""Version of the result layout (``schema/document.schema.json``): the major part changes when a
field is removed or changes meaning, the minor part when fields are added."""

SCHEMA_PATH = Path(__file__).parent / "schema" / "document.schema.json"


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
    """

    name: str
    format: str
    sha256: str | None
    page_count: int
    pages: tuple[int, ...]

    @classmethod
    def from_opened(cls, opened: Any) -> InputInfo:
        """From an ``inputs.OpenedDocument`` (or anything with its attributes)."""
        return cls(
            opened.name, opened.format, getattr(opened, "sha256", None), opened.page_count, tuple(opened.page_indices)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": self.format,
            "sha256": self.sha256,
            "page_count": self.page_count,
            "pages": list(self.pages),
        }


def result_metadata(parser: DocumentParser, source: InputInfo | None) -> dict[str, Any]:
    """The metadata block of a result parsed by ``parser`` from ``source``.

    Args:
        parser: the parser (its options, model and runtime choices are recorded).
        source: the input; None when it could not be opened.

    Returns:
        A JSON-ready dict (see the module docstring); ``tier`` is the tier the parser runs
        (``ParserOptions.resolved_tier``).
    """
    from . import __version__

    options = parser.options.to_dict()
    info = parser.model_info
    return {
        "schema_version": SCHEMA_VERSION,
        "package": {"name": "mineru-fast", "version": __version__},
        "input": source.to_dict() if source is not None else None,
        "model": {
            "model_id": info.model_id,
            "revision": info.revision,
            "commit": info.commit,
            "name": info.local_dir.name,
            "protocol_version": parser.model_version,
        },
        "tier": parser.tier,
        "options": options,
        "runtime": parser.runtime,
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
        from . import __version__

        metadata = {"schema_version": SCHEMA_VERSION, "package": {"name": "mineru-fast", "version": __version__}}
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
