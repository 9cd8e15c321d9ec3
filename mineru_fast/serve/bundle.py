"""One parse as MinerU 4's result bundle, held in the job's result: what MinerU's document API
(``mineru_api``) hands out.

A ``BundleRequest`` is a ``ParseRequest`` whose job result carries the bundle's files.
``run_bundle`` parses it page by page (``parsing.run_parse``) into a ``writer.DocumentWriter`` in
a temporary folder of the worker, so each page's crops are written as the page comes and memory
stays flat in the page count; then it reads back the outputs asked for: ``markdown.md``,
``middle_json.json``, ``structured_content.json`` as text, and the whole bundle (those files,
``model_output.json`` and ``images/``) as a zip (``formats.zip_bundle``, what ``mineru-fast parse
-f zip`` writes), base64 in the result so the result stays JSON-ready. The folder is removed
before the job ends; no name in it comes from the client.
"""

from __future__ import annotations

import base64
import io
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.results.document import Document
from mineru_fast.results.formats import zip_bundle
from mineru_fast.results.page import Page
from mineru_fast.results.writer import MARKDOWN, MIDDLE_JSON, STRUCTURED, DocumentWriter
from mineru_fast.serve.parsing import ParseRequest, render_result, run_parse

__all__ = ["BUNDLE_OUTPUTS", "BundleRequest", "run_bundle"]

BUNDLE_OUTPUTS = ("markdown", "middle_json", "structured_content", "zip")
"""The outputs of MinerU 4's API server (mineru 4.0.12 ``api_server._LOCAL_PARSE_OUTPUT_FORMATS``)."""
_FILES = {"markdown": MARKDOWN, "middle_json": MIDDLE_JSON, "structured_content": STRUCTURED}


@dataclass(frozen=True)
class BundleRequest(ParseRequest):
    """A document to parse into MinerU 4's bundle (``ParseRequest``'s fields, ``formats`` unused).

    Attributes:
        name: the document's name in the bundle's record (``extensions["mineru_fast"]["name"]``).
        outputs: what the result keeps, a subset of ``BUNDLE_OUTPUTS``.
    """

    name: str = "document"
    outputs: frozenset[str] = frozenset({"markdown"})


def run_bundle(
    parser: DocumentParser, request: BundleRequest, progress: Callable[[int, int], None] | None = None
) -> dict:
    """Parse a document into MinerU 4's bundle and keep the outputs asked for.

    Args:
        parser: the service's parser.
        request: the document, its options and the outputs wanted.
        progress: called as ``progress(pages_done, pages_total)``.

    Returns:
        ``parsing.render_result``'s summary (status, metadata, errors, pages, timings, counts)
        and ``bundle``: for each output asked for, ``{"bytes": size}`` with ``content`` (the
        file's text) or, for ``zip``, ``base64`` (the archive).

    Raises:
        InputError: the document cannot be opened. TraceError: the trace does not fit it.
        OutputError: the worker's temporary folder cannot be written.
    """
    with tempfile.TemporaryDirectory(prefix="mineru-fast-bundle-") as temporary:
        folder = Path(temporary)
        with DocumentWriter(folder, request.name) as writer:  # an exception closes it, recorded as a failure

            def write(_: Document, page: Page) -> None:
                writer.add_page(page)  # its crops written, then its images released

            document, _ = run_parse(parser, request, progress, on_page=write)
            writer.metadata = document.metadata  # known once the document is open; read by close
            writer.close(document.errors, document.timings.get("wall"))
        bundle: dict[str, dict] = {}
        for output in sorted(request.outputs):
            if output == "zip":
                archive = io.BytesIO()
                zip_bundle(folder, archive)
                data = archive.getvalue()
                bundle[output] = {"bytes": len(data), "base64": base64.b64encode(data).decode("ascii")}
            else:
                raw = (folder / _FILES[output]).read_bytes()
                bundle[output] = {"bytes": len(raw), "content": raw.decode("utf-8")}
    return {**render_result(document, frozenset()), "bundle": bundle}
