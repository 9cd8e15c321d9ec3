"""The parsing side of ``mineru-fast batch``, without Ray (testable alone).

``inspect_document`` is the CPU step that comes first (a Ray Data task in ``batch``): which pages a
document's selection holds (its ``InputInfo``), from the document's bytes, or from the ``Source``
of a URI input that it reads itself.

``DocumentWorker`` is the body of a batch actor: it holds one ``DocumentParser`` and parses the
pages of a document. It writes each page's images (crops, layout overlay) into a temporary
directory of its own and hands them back as bytes with the page, so no file system needs to be
shared between the machines of a cluster; the driver assembles the document's Markdown, content
list and JSON from the pages (``assembly``). ``parse`` runs the pages of one task (the whole
selection, or a part of it) and yields, in order, one ``{"kind": "page", "index", "status",
"page", "files"}`` per page (``page``: the ``Page`` without its images; ``files``: relative path ->
bytes), then ``{"kind": "done"}``; a document that cannot be read at all yields ``{"kind":
"error", "error"}`` instead. ``run_task`` gathers those events into the task's one result.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from mineru_fast.distributed.sources import Source
from mineru_fast.errors import InputError, TraceError
from mineru_fast.inputs.documents import DEFAULT_MAX_PAGES
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.traces import Trace
from mineru_fast.results.metadata import InputInfo
from mineru_fast.runtime.cpu import format_cpulist

__all__ = ["DocumentWorker", "inspect_document"]


def _take_files(root: Path) -> dict[str, bytes]:
    """The files below ``root`` as relative path -> bytes, each removed once read."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        files[path.relative_to(root).as_posix()] = path.read_bytes()
        path.unlink()
    return files


def inspect_document(
    name: str,
    data: bytes | Source,
    pages: str | None = None,
    password: str | None = None,
    max_pages: int = DEFAULT_MAX_PAGES,
) -> InputInfo:
    """What the driver needs before it splits a document into tasks (no parser needed).

    Args:
        name: the output stem (the metadata block names the document by it, as ``parse`` does).
        data: the document's bytes, or the ``Source`` of a URI input (read here).
        pages / password: as ``DocumentParser.iter_pages`` (the document's whole selection).
        max_pages: as ``ParserOptions.max_pages`` (``TooManyPages`` above it).

    Returns:
        The document's ``InputInfo`` named ``name``: ``pages`` holds the 0-based indices selected.

    Raises:
        InputError: the document cannot be read (``SourceError`` included).
    """
    from mineru_fast.inputs.documents import open_document

    with open_document(_read(data), pages=pages, password=password, max_pages=max_pages) as opened:
        return replace(InputInfo.from_opened(opened), name=name)


class DocumentWorker:
    """One parser (``DocumentParser.from_pretrained``) with ``threads`` intra-op threads.

    Args:
        model: model directory or hub id (every node must reach it: a shared or copied path).
        options: parser options; their ``threads`` is replaced by ``threads``.
        threads: intra-op threads, the CPUs Ray reserved for this actor.
        pin: pin the process to ``threads`` cores of one NUMA node where the machine has several
            (``placement.pin_actor``), before the model loads.
        overlays: also write each page's layout overlay (MinerU 2.x's layout has them, MinerU 4's
            bundle does not).

    Raises:
        OSError: ``pin`` and the kernel refused the affinity.
    """

    def __init__(
        self, model: str, options: ParserOptions, threads: int, pin: bool = False, overlays: bool = True
    ) -> None:
        from mineru_fast.distributed.placement import pin_actor
        from mineru_fast.runtime.threads import configure_process

        pinned = pin_actor(threads) if pin else None
        self.group = pinned[0] if pinned else None
        self._slot = pinned[1] if pinned else None  # the slot's lock, held for the actor's life
        configure_process(threads, bind=False)  # before torch loads (Ray also sets OMP_NUM_THREADS)
        from mineru_fast.pipeline.parser import DocumentParser

        self.threads, self.overlays = threads, overlays
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
        data: bytes | Source,
        trace: Trace | None = None,
        pages: str | None = None,
        password: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Parse pages of one document and stream them (see the module's events).

        Args:
            data: the document's bytes, or the ``Source`` of a URI input (read here).
            trace: replayed outputs of the whole document (tests, benchmarks) or None.
            pages: the pages of this task, 1-based (``"3-4"``), or None for all.
            password: as ``DocumentParser.iter_pages``.

        Yields:
            The events; unreadable input (``InputError``, ``SourceError``, ``TraceError``) ends in
            an ``error`` event. Any other exception propagates (the batch retries the task).
        """
        from mineru_fast.results.writer import render_page, write_page_images

        root = Path(tempfile.mkdtemp(prefix="mineru-fast-batch-"))
        try:
            try:
                for page in self.parser.iter_pages(
                    _read(data), pages=pages, password=password, replay=trace, keep_page_images=True
                ):
                    write_page_images(root, page, render_page(page).crops, overlay=self.overlays)
                    page.image, page.crops = None, {}  # written: the page travels as its record
                    yield {"kind": "page", "index": page.index, "status": page.status, "page": page,
                           "files": _take_files(root)}  # fmt: skip
            except (InputError, TraceError) as exc:
                yield {"kind": "error", "error": f"{type(exc).__name__}: {exc}"}
                return
            yield {"kind": "done"}
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def run_task(
        self,
        data: bytes | Source,
        trace: Trace | None = None,
        pages: str | None = None,
        password: str | None = None,
        on_page: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Parse the pages of one task and gather them into one result.

        Args:
            data / trace / pages / password: as ``parse``.
            on_page: called with each ``page`` event as it is parsed (``files`` and ``page`` left out).

        Returns:
            ``{"pages": [Page, ...], "files": {relative path: bytes}}`` (the pages in order), or
            ``{"error": "Type: message"}`` when the document cannot be read.
        """
        gathered: list[Any] = []
        files: dict[str, bytes] = {}
        for event in self.parse(data, trace, pages, password):
            if event["kind"] == "error":
                return {"error": event["error"]}
            if event["kind"] == "page":
                gathered.append(event["page"])
                files.update(event["files"])
                if on_page is not None:
                    on_page({**event, "files": None, "page": None})
        return {"pages": gathered, "files": files}


def _read(data: bytes | Source) -> bytes:
    """The document's bytes (a ``Source`` is read here, on the actor's node).

    Raises:
        SourceError: the source cannot be read.
    """
    return data.read() if isinstance(data, Source) else data
