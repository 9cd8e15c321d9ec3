"""What a parse writes for one document: MinerU 4's result bundle, one of the files its CLI writes,
a target DocVortex renders, or MinerU 2.x's layout (``-f`` / ``--format`` of ``parse``).

- ``bundle`` (default): ``OUTPUT/<stem>/`` holds MinerU 4's bundle (``writer.BUNDLE_FILES`` and
  ``images/``), the tree mineru 4.0.12's ``ParseResult.save`` writes.
- ``markdown``, ``middle_json``, ``zip``: the file ``mineru-kit parse -f FORMAT -o OUTPUT`` writes,
  ``OUTPUT/<stem>.md``, ``OUTPUT/<stem>.json`` or ``OUTPUT/<stem>.zip`` (the bundle zipped, as
  ``mineru.kit.common.save_parse_result`` zips it: every file, sorted, deflated).
- ``html``, ``latex``, ``docx``, ``epub``, ``pdf``: the bundle, and ``OUTPUT/<stem>/<stem>.<suffix>``
  rendered from it by DocVortex (``official``; needs the ``mineru4`` extra), next to the images it
  references.
- ``2.x``: ``OUTPUT/<stem>/`` in MinerU 2.x's layout (``<stem>.md``, ``<stem>_content_list.json``,
  mineru-fast's ``<stem>.json``, ``images/``, ``layout/``).

``markdown``, ``middle_json`` and ``zip`` are made from a bundle written page by page into the
hidden folder ``OUTPUT/.<stem>/`` (as mineru's CLI stages its zip), removed once the file is in
place.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import IO

from mineru_fast.errors import MineruFastError

__all__ = ["FORMATS", "OFFICIAL_TARGETS", "DEFAULT_FORMAT", "writer_folder", "destination", "finish", "zip_bundle"]

# mineru 4.0.12 mineru/kit/common.py OUTPUT_FILE_SUFFIXES (its -f choices), then DocVortex's targets.
_SINGLE_FILES = {"markdown": ".md", "middle_json": ".json", "zip": ".zip"}
OFFICIAL_TARGETS = {"html": ".html", "latex": ".tex", "docx": ".docx", "epub": ".epub", "pdf": ".pdf"}
FORMATS = ("bundle", *_SINGLE_FILES, *OFFICIAL_TARGETS, "2.x")
DEFAULT_FORMAT = "bundle"


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise MineruFastError(f"unknown output format {fmt!r}; choose from {', '.join(FORMATS)}")


def writer_folder(output: Path, stem: str, fmt: str) -> Path:
    """The folder a ``DocumentWriter`` writes document ``stem`` into for format ``fmt``.

    Raises:
        MineruFastError: an unknown format.
    """
    _check(fmt)
    return output / f".{stem}" if fmt in _SINGLE_FILES else output / stem


def destination(output: Path, stem: str, fmt: str) -> Path:
    """Where document ``stem``'s result ends up for format ``fmt`` (a folder or a file).

    Raises:
        MineruFastError: an unknown format.
    """
    _check(fmt)
    if fmt in OFFICIAL_TARGETS:
        return output / stem / f"{stem}{OFFICIAL_TARGETS[fmt]}"
    return output / f"{stem}{_SINGLE_FILES[fmt]}" if fmt in _SINGLE_FILES else output / stem


def finish(folder: Path, output: Path, stem: str, fmt: str) -> Path:
    """Make format ``fmt``'s file from the bundle in ``folder`` (``writer_folder``): a DocVortex
    target is rendered next to it, a single file replaces it. Nothing to do for ``bundle`` and
    ``2.x``. Returns ``destination(output, stem, fmt)``.

    Raises:
        MineruFastError: an unknown format; ``official.OfficialRendererMissing`` for a DocVortex
            target without DocVortex (the bundle stays).
        OSError: the file cannot be written.
    """
    dest = destination(output, stem, fmt)
    if fmt in ("bundle", "2.x"):
        return dest
    if fmt in OFFICIAL_TARGETS:
        from mineru_fast.results.official import render_bundle

        render_bundle(folder, fmt, dest)
        return dest
    if fmt == "zip":
        partial = dest.with_name(dest.name + ".part")
        zip_bundle(folder, partial)
        partial.replace(dest)
    else:
        shutil.copyfile(folder / ("markdown.md" if fmt == "markdown" else "middle_json.json"), dest)
    shutil.rmtree(folder)
    return dest


def zip_bundle(folder: Path, target: Path | IO[bytes]) -> None:
    """Zip the bundle in ``folder`` into ``target`` (a path or a binary file) as
    ``mineru.kit.common.save_parse_result`` zips it: every file, by its path relative to
    ``folder``, sorted, deflated.

    Raises:
        OSError: a file cannot be read or the archive written.
    """
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for child in sorted(folder.rglob("*")):
            if child.is_file():
                archive.write(child, arcname=child.relative_to(folder).as_posix())
