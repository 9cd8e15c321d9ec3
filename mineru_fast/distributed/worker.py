"""``DocumentWorker``: the body of a batch actor. It holds one ``DocumentParser`` and parses a
document, given as bytes or as the ``Source`` of a URI input (read here), into a temporary
directory of its own (``DocumentWriter``), streaming the output files back as events, so that no
file system needs to be shared between the machines of a cluster and a long document never sits
whole in memory.

Events (plain dicts, in order): one ``{"kind": "page", "index", "status", "files"}`` per page
(``files``: the page's crops and layout overlay, relative path -> bytes), then either
``{"kind": "done", "status", "pages", "files"}`` (the Markdown, content list and JSON) or, when the
document cannot be read at all, ``{"kind": "error", "error"}``.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cpu import format_cpulist
from ..errors import InputError, TraceError
from ..options import ParserOptions
from ..traces import Trace
from .sources import Source

__all__ = ["DocumentWorker"]

_PAGE_DIRS = ("images", "layout")  # what a page adds; the other files are final only at close


def _new_files(root: Path, sent: set[str], under: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """Files below ``root`` not in ``sent`` (optionally only in the folders ``under``); marks them sent."""
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in sent and (under is None or rel.split("/", 1)[0] in under):
            files[rel] = path.read_bytes()
            sent.add(rel)
    return files


class DocumentWorker:
    """One parser (``DocumentParser.from_pretrained``) with ``threads`` intra-op threads.

    Args:
        model: model directory or hub id (every node must reach it: a shared or copied path).
        options: parser options; their ``threads`` is replaced by ``threads``.
        threads: intra-op threads, the CPUs Ray reserved for this actor.
        pin: pin the process to ``threads`` cores of one NUMA node where the machine has several
            (``placement.pin_actor``), before the model loads.

    Raises:
        OSError: ``pin`` and the kernel refused the affinity.
    """

    def __init__(self, model: str, options: ParserOptions, threads: int, pin: bool = False) -> None:
        from ..threads import configure_process
        from .placement import pin_actor

        pinned = pin_actor(threads) if pin else None
        self.group = pinned[0] if pinned else None
        self._slot = pinned[1] if pinned else None  # the slot's lock, held for the actor's life
        configure_process(threads, bind=False)  # before torch loads (Ray also sets OMP_NUM_THREADS)
        from ..parser import DocumentParser

        self.threads = threads
        self.parser = DocumentParser.from_pretrained(model, replace(options, threads=threads, progress=False))

    def describe(self) -> dict[str, Any]:
        """Where the worker runs: ``{"host", "threads", "cpus", "node"}`` (``cpus``: the cpulist it
        is pinned to, ``node`` its NUMA node, both None when not pinned; also a readiness check)."""
        group = self.group
        cpus = format_cpulist(group.cpus) if group is not None else None
        return {"host": socket.gethostname(), "threads": self.threads, "cpus": cpus,
                "node": group.node if group is not None else None}  # fmt: skip

    def parse(
        self,
        name: str,
        data: bytes | Source,
        trace: Trace | None = None,
        pages: str | None = None,
        password: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Parse one document and stream its outputs (see the module's events).

        Args:
            name: the output stem (``<name>.md`` ...).
            data: the document's bytes (PDF or image; the format is sniffed), or the ``Source`` of
                a URI input, read here.
            trace: replayed outputs (tests, benchmarks) or None.
            pages / password: as ``DocumentParser.iter_pages``.

        Yields:
            The events; unreadable input (``InputError``, ``SourceError``, ``TraceError``) ends in an ``error``
            event. Any other exception propagates (the batch retries the document).
        """
        from ..inputs import open_document
        from ..metadata import InputInfo
        from ..writer import DocumentWriter

        try:  # the metadata block names the document as sequential parse does (its stem)
            if isinstance(data, Source):
                data = data.read()
            with open_document(data, pages=pages, password=password) as opened:
                info = replace(InputInfo.from_opened(opened), name=name)
        except InputError as exc:
            yield {"kind": "error", "error": f"{type(exc).__name__}: {exc}"}
            return
        root = Path(tempfile.mkdtemp(prefix="mineru-fast-batch-"))
        sent: set[str] = set()
        start = time.perf_counter()
        try:
            with DocumentWriter(root / "out", name, metadata=self.parser.result_metadata(info)) as writer:
                try:
                    for page in self.parser.iter_pages(
                        data, pages=pages, password=password, replay=trace, keep_page_images=True
                    ):
                        writer.add_page(page)
                        files = _new_files(root / "out", sent, _PAGE_DIRS)
                        yield {"kind": "page", "index": page.index, "status": page.status, "files": files}
                except (InputError, TraceError) as exc:
                    yield {"kind": "error", "error": f"{type(exc).__name__}: {exc}"}
                    return
                wall_s = time.perf_counter() - start
                writer.close(wall_s=wall_s)
            yield {"kind": "done", "status": writer.document_status, "pages": len(writer.statuses),
                   "wall_s": round(wall_s, 3), "files": _new_files(root / "out", sent)}  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
