"""Write a document's outputs page by page, so memory stays flat however long the document is.

``DocumentWriter.add_page`` writes a finished page's crops and layout overlay at once, appends the
page (without images) to ``<name>.pages.jsonl``, and lets the page go. ``close`` assembles
``<name>.md``, ``<name>_content_list.json`` and ``<name>.json`` from that file, reading one page at
a time, then removes it. While a long document runs, the pages already done are on disk.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from .document import Document, Page, save_page_images

__all__ = ["DocumentWriter"]


def _write_json_array(out: IO[str], items: Iterable[object], indent: int, level: int = 0) -> None:
    """Write ``items`` as ``json.dumps(list(items), indent=indent, ensure_ascii=False)`` would at
    nesting ``level``, without holding the list."""
    out.write("[")
    first = True
    for item in items:
        out.write("\n" if first else ",\n")
        out.write(textwrap.indent(json.dumps(item, ensure_ascii=False, indent=indent), " " * indent * (level + 1)))
        first = False
    out.write("]" if first else "\n" + " " * indent * level + "]")


class DocumentWriter:
    """Streams one document's outputs into ``out_dir`` (created if needed).

    Args:
        out_dir: the document's output directory (``OUT/<stem>`` in the CLI).
        name: the file stem of the outputs.
    """

    def __init__(self, out_dir: str | Path, name: str) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._pages_path = self.out / f"{name}.pages.jsonl"
        self._pages = self._pages_path.open("w", encoding="utf-8")
        self.statuses: list[str] = []
        self.timings: dict[str, float] = {}
        self.document_status: str | None = None  # set by close

    def add_page(self, page: Page) -> None:
        """Write the page's crops and overlay, record it, and drop its images."""
        save_page_images(page, self.out)
        page.image = None
        for block in page.blocks:
            block.image = None
        self._pages.write(json.dumps(page.to_dict(), ensure_ascii=False) + "\n")
        self._pages.flush()
        self.statuses.append(page.status)
        for key, value in page.timings.items():
            self.timings[key] = self.timings.get(key, 0.0) + value

    def _read_pages(self) -> Iterator[Page]:
        with self._pages_path.open(encoding="utf-8") as lines:
            for line in lines:
                yield Page.from_dict(json.loads(line))

    def close(self, errors: list[str] | None = None, wall_s: float | None = None) -> Path:
        """Assemble the Markdown, content list and full JSON from the recorded pages.

        Args:
            errors: document-level errors to record.
            wall_s: wall-clock seconds of the parse, recorded as ``timings["wall"]``.

        Returns:
            The output directory.
        """
        self._pages.close()
        errors = list(errors or [])
        timings = dict(self.timings)
        if wall_s is not None:
            timings["wall"] = wall_s
        status = self.document_status = Document.status_of(errors, self.statuses)
        with (self.out / f"{self.name}.md").open("w", encoding="utf-8") as md:
            parts = (Document.page_markdown(page) for page in self._read_pages())
            md.write("\n\n".join(part for part in parts if part) + "\n")
        with (self.out / f"{self.name}_content_list.json").open("w", encoding="utf-8") as cl:
            items = (item for page in self._read_pages() for item in Document.page_content_list(page))
            _write_json_array(cl, items, indent=2)
        with (self.out / f"{self.name}.json").open("w", encoding="utf-8") as full:
            head = {"name": self.name, "status": status, "errors": errors, "timings": timings}
            full.write(json.dumps(head, ensure_ascii=False, indent=2)[:-2] + ',\n  "pages": ')
            _write_json_array(full, (page.to_dict() for page in self._read_pages()), indent=2, level=1)
            full.write("\n}")
        self._pages_path.unlink()
        return self.out
