"""MinerU 4's own renderers, where DocVortex is installed (the ``mineru4`` extra).

DocVortex (the library mineru 4.0.12 renders every target with) reads a bundle's
``middle_json.json`` (``docvortex.schema.MiddleJson``, validated on the way in) and renders
Markdown, HTML, LaTeX, DOCX, EPUB, PDF or structured content from it (``docvortex.render.render``).
Images are the bundle's ``images/`` files: HTML and LaTeX reference them by relative path, DOCX,
EPUB and PDF embed them (an asset resolver that reads only files inside the bundle).

Without DocVortex, mineru-fast's own renderer writes Markdown and the structured content
(``writer``); the other targets raise ``OfficialRendererMissing``, which names the extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mineru_fast.errors import MineruFastError

__all__ = ["OfficialRendererMissing", "TARGETS", "available", "load_middle_json", "render", "render_bundle"]

TARGETS = ("markdown", "html", "latex", "docx", "epub", "pdf", "structured_content")
"""docvortex.render.RenderFormat's values (docvortex 0.6.4)."""


class OfficialRendererMissing(MineruFastError):
    """A target only DocVortex renders was asked for, and DocVortex is not installed."""

    code = "official_renderer_missing"


def available() -> bool:
    """Whether DocVortex can be imported here."""
    try:
        import docvortex.render  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not available():
        raise OfficialRendererMissing(
            "rendering HTML, LaTeX, DOCX, EPUB or PDF needs DocVortex, MinerU 4's renderer: "
            "pip install 'mineru-fast[mineru4]'"
        )


def load_middle_json(path: str | Path) -> Any:
    """A ``middle_json.json`` as DocVortex's ``MiddleJson``, validated against its schema.

    Raises:
        OfficialRendererMissing: DocVortex is not installed.
        ValueError: the file is not a valid middle JSON (pydantic's ``ValidationError`` is one).
    """
    _require()
    from docvortex.schema import MiddleJson

    return MiddleJson.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def render(bundle: str | Path, target: str) -> str | bytes | dict:
    """Render a bundle's middle JSON to ``target`` (one of ``TARGETS``) with DocVortex.

    Args:
        bundle: a folder holding ``middle_json.json`` and the ``images/`` it references.
        target: the target format.

    Returns:
        Text (Markdown, HTML, LaTeX), bytes (DOCX, EPUB, PDF) or a dict (structured content).

    Raises:
        OfficialRendererMissing: DocVortex is not installed.
        MineruFastError: an unknown target.
        ValueError: the middle JSON is not valid.
    """
    if target not in TARGETS:
        raise MineruFastError(f"unknown render target {target!r}; choose from {', '.join(TARGETS)}")
    _require()
    from docvortex.render import (
        DocxRenderOptions,
        EpubRenderOptions,
        PdfRenderOptions,
        RenderFormat,
    )
    from docvortex.render import render as docvortex_render

    root = Path(bundle).resolve()
    middle = load_middle_json(root / "middle_json.json")

    def asset(path: str) -> bytes:
        file = (root / path).resolve()
        if root not in file.parents:
            raise ValueError(f"asset {path!r} is outside the bundle")
        return file.read_bytes()

    options: dict[str, Any] = {
        "docx": DocxRenderOptions(asset_resolver=asset),
        "epub": EpubRenderOptions(asset_resolver=asset),
        "pdf": PdfRenderOptions(asset_resolver=asset),
    }
    return docvortex_render(middle, RenderFormat(target), options=options.get(target))


def render_bundle(bundle: str | Path, target: str, dest: str | Path) -> Path:
    """``render`` a bundle and write the result to ``dest`` (UTF-8 text, bytes, or JSON with an
    indent of 2); returns ``dest``. Errors are ``render``'s and ``OSError``."""
    output = render(bundle, target)
    dest = Path(dest)
    if isinstance(output, bytes):
        dest.write_bytes(output)
    elif isinstance(output, dict):
        dest.write_text(json.dumps(output, ensure_ascii=False, indent=2), encoding="utf-8")
    else:
        dest.write_bytes(output.encode("utf-8"))
    return dest
