"""The batch manifest: ``OUTPUT/manifest.jsonl``, one JSON object per finished document.

Fields: ``document`` (the input path as given), ``name`` (its output folder ``OUTPUT/<name>/``),
``status`` (``success`` / ``partial`` / ``failure``: parsed, outputs written, as the document's
status; ``error``: no outputs, the input was unreadable or every attempt failed), ``pages``,
``error`` (None, the last error, or for a parsed document with pages not in ``success`` the first
such page's problem), ``attempts`` (the most any of its tasks took), ``wall_s``,
``failed_pages`` (1-based pages whose task failed on every attempt; they are ``failure`` pages in
the outputs, and the document is ``partial`` or ``failure``) and ``runtimes`` (``[]``, or when the
document's pages ran under more than one runtime, i.e. numerics, each runtime with its pages as
``{"pages": [1-based page, ...], "runtime": {...}}``, as the outputs' ``metadata.runtimes`` with
0-based pages). Runs append; the last record of a document is its state. A resumed run skips the
documents whose last record has outputs and whose ``OUTPUT/<name>/<name>.json`` exists.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "Record", "Manifest"]

MANIFEST = "manifest.jsonl"
PARSED = ("success", "partial", "failure")  # statuses whose outputs were written


@dataclass(frozen=True)
class Record:
    """The outcome of one document (see the module docstring for the fields)."""

    document: str
    name: str
    status: str
    pages: int
    error: str | None
    attempts: int
    wall_s: float
    failed_pages: list[int] = field(default_factory=list)
    runtimes: list[dict[str, Any]] = field(default_factory=list)


class Manifest:
    """Appends records to ``OUTPUT/manifest.jsonl`` (thread-safe) and reads them back.

    Args:
        output: the batch output directory (created).
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output / MANIFEST
        self._lock = threading.Lock()
        output.mkdir(parents=True, exist_ok=True)

    def append(self, record: Record) -> None:
        """Write one record on a line of its own and flush it to the file. A last line torn by a
        crash mid-write (no line end) is ended first, so this record never continues it."""
        line = json.dumps(asdict(record), ensure_ascii=False) + "\n"
        with self._lock, self.path.open("ab+") as out:
            if out.seek(0, 2):  # not empty: is its last line ended?
                out.seek(-1, 2)
                if out.read(1) != b"\n":
                    line = "\n" + line
            out.write(line.encode("utf-8"))  # "a" mode: at the end, wherever the reads left off

    def records(self) -> dict[str, Record]:
        """The last record of each output name; a torn last line is ignored."""
        last: dict[str, Record] = {}
        if not self.path.is_file():
            return last
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = Record(**json.loads(line))
            except (ValueError, TypeError):
                continue  # a line cut by a crash mid-write
            last[record.name] = record
        return last

    def complete(self) -> set[str]:
        """Names whose outputs are complete: parsed, and their last file in place
        (``OUTPUT/<name>/middle_json.json`` of MinerU 4's bundle, or the 2.x layout's
        ``OUTPUT/<name>/<name>.json``)."""
        return {
            name
            for name, record in self.records().items()
            if record.status in PARSED
            and any((self.output / name / file).is_file() for file in ("middle_json.json", f"{name}.json"))
        }
