"""What the service does with one document: check it, parse it with progress, render the result.

The check before a job is queued reads headers only (format, pages, each page's size): no pixel
is decoded in the request path; decoding happens in the workers, under the queue bound. Nothing a
client sends is written to disk under a name it chose. The format is sniffed from the content by
``mineru_fast.inputs.documents.open_document``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

from mineru_fast.engine.memory import trim_heap
from mineru_fast.errors import CorruptDocument, ImageTooLarge, TraceError
from mineru_fast.inputs.documents import OpenedDocument, PageLimits, open_document
from mineru_fast.options import ParserOptions
from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.protocol.traces import PageTrace, Trace, trace_from_dict
from mineru_fast.results.document import Document
from mineru_fast.results.metadata import InputInfo
from mineru_fast.results.page import Page, layout_overlay
from mineru_fast.serve.errors import ApiError

logger = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "DEFAULT_FORMATS",
    "ParseRequest",
    "DocumentInfo",
    "parse_formats",
    "trace_from_json",
    "inspect_document",
    "decode_cost",
    "run_parse",
    "render_result",
    "canary_image",
    "run_canary",
]

FORMATS = ("markdown", "middle_json", "structured_content", "content_list", "json", "layout")
"""Result parts a client may ask for: MinerU 4's Markdown, middle JSON and structured content (the
files of its result bundle, ``Document.to_middle_json`` / ``to_structured_content``), the content
list, the full ``Document.to_dict()``, and layout overlays (one JPEG per page, base64)."""
DEFAULT_FORMATS = frozenset({"markdown", "middle_json"})
OVERLAY_MAX_SIDE = 1400  # long side of the overlay images returned, in pixels


@dataclass(frozen=True)
class ParseRequest:
    """One document to parse, as received.

    Attributes:
        data: the document's bytes (PDF or image).
        pages: 1-based page range such as ``"1-3,5"``; None = every page.
        password: user password of an encrypted PDF (never logged).
        formats: result parts to return (subset of ``FORMATS``).
        trace: replay trace (tests and benchmarks), or None.
    """

    data: bytes = field(repr=False)
    pages: str | None = None
    password: str | None = field(default=None, repr=False)
    formats: frozenset[str] = DEFAULT_FORMATS
    trace: Trace | None = field(default=None, repr=False)

    def fingerprint(self) -> str:
        """What the request asks for, as a SHA-256 hex digest: the document's bytes, the page
        range, the formats, and whether a password and a replay trace came with it (not their
        values). Two submissions under one ``Idempotency-Key`` must have the same."""
        document = hashlib.sha256(self.data).hexdigest()
        asked = [document, self.pages, sorted(self.formats), self.password is not None, self.trace is not None]
        return hashlib.sha256(json.dumps(asked).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DocumentInfo:
    """What a quick look at a document found.

    Attributes:
        format: ``"pdf"`` or the Pillow format name.
        page_count: pages in the whole document.
        selected: 0-based indices of the pages that will be parsed.
        cost: bytes of page images a worker holds at once while parsing it (``decode_cost``).
    """

    format: str
    page_count: int
    selected: list[int]
    cost: int


def parse_formats(text: str | None) -> frozenset[str]:
    """``"markdown,layout"`` -> the set of result parts; empty or None -> ``DEFAULT_FORMATS``.

    Raises:
        ApiError: 422 ``invalid_request`` for an unknown part.
    """
    if text is None or not text.strip():
        return DEFAULT_FORMATS
    parts = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(parts - set(FORMATS))
    if unknown:
        raise ApiError(
            422, "invalid_request", f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}"
        )
    return parts or DEFAULT_FORMATS


def trace_from_json(data: bytes) -> Trace:
    """A replay trace from uploaded JSON (schema in ``mineru_fast.protocol.traces``).

    Raises:
        TraceError: not UTF-8 JSON, or not ``{"pages": [{"layout": str, "contents": [str|null]}]}``.
    """
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TraceError(f"the replay trace is not valid JSON: {exc}") from None
    return trace_from_dict(raw, "the replay trace")


def _limits(parser_options: ParserOptions) -> PageLimits:
    return PageLimits(
        dpi=parser_options.dpi,
        max_side=parser_options.max_side,
        max_pixels=parser_options.max_image_pixels,
        render_timeout=parser_options.render_timeout,
    )


def decode_cost(pages: list[tuple[int, int]], page_window: int) -> int:
    """Bytes a worker holds at once for its page images while parsing a document.

    A worker renders one page at a time (``OpenedDocument.render``: its peak) while it keeps the
    other pages of its window as rendered RGB images, so the bound is the largest peak plus
    ``page_window - 1`` of the largest kept pages.

    Args:
        pages: ``(peak, kept)`` bytes of each selected page (``OpenedDocument.page_cost``).
        page_window: pages parsed together (``ParserOptions.page_window``).

    Returns:
        The bound in bytes (0 for no page).
    """
    if not pages:
        return 0
    peak = max(p for p, _ in pages)
    kept = max(k for _, k in pages)
    return peak + (min(page_window, len(pages)) - 1) * kept


def _page_cost(opened: OpenedDocument, index: int) -> tuple[int, int] | None:
    """``opened.page_cost(index)``, or None for a page whose header is damaged or over the pixel
    limit: the worker fails that page alone, from the same header, without decoding it (as
    ``DocumentParser`` does), so it costs nothing."""
    try:
        return opened.page_cost(index)
    except (CorruptDocument, ImageTooLarge):
        return None


def inspect_document(request: ParseRequest, parser_options: ParserOptions, max_pages: int) -> DocumentInfo:
    """Read a document's headers: format, page count, selected pages, and what decoding will cost.

    No page is rendered or decoded, so this is cheap whatever the upload holds; every selected page
    is checked against ``max_image_pixels`` from its header. A page after the first that fails
    that check (or whose header is damaged) is not an error here: the parse fails that page alone.

    Args:
        request: the upload and its options.
        parser_options: the service's ``ParserOptions`` (input limits, page window).
        max_pages: most pages one request may select.

    Raises:
        InputError: unsupported format, corrupt headers, encrypted without the right password, a
            first page over the pixel limit, or a bad page range (the ``mineru_fast.errors``
            subclasses).
        TraceError: the replay trace has fewer pages than the document.
        ApiError: 422 ``too_many_pages`` when more than ``max_pages`` pages are selected.
    """
    limits = _limits(parser_options)
    with open_document(
        request.data, pages=request.pages, password=request.password, decode_first=False, **limits
    ) as opened:
        selected = list(opened.page_indices)
        if len(selected) > max_pages:
            raise ApiError(
                422, "too_many_pages", f"{len(selected)} pages selected; this server parses at most {max_pages}"
            )
        costs = [page for index in selected if (page := _page_cost(opened, index)) is not None]
        page_count, format_name = opened.page_count, opened.format
    if request.trace is not None and len(request.trace.pages) < page_count:
        raise TraceError(f"the replay trace has {len(request.trace.pages)} pages, the document {page_count}")
    cost = decode_cost(costs, parser_options.page_window)
    return DocumentInfo(format_name, page_count, selected, cost)


def run_parse(
    parser: DocumentParser,
    request: ParseRequest,
    progress: Callable[[int, int], None] | None = None,
    on_page: Callable[[Document, Page], None] | None = None,
) -> tuple[Document, list[dict]]:
    """Parse a document page by page (``DocumentParser.iter_pages``), reporting progress per page.

    Each page's image is released as soon as the page is done (after its overlay is encoded, when
    the request asks for ``layout``), so a long upload holds a window of pages, not all of them;
    the heap is then trimmed (``trim_heap``). A job runs in a worker thread, whose malloc arena
    keeps the freed page buffers (a rendered Letter page is ~15 MB) resident: without the trim the
    free heap held after a job was ~210 MB and the server's peak grew with the page count.

    Args:
        parser: the service's parser.
        request: the document and its options.
        progress: called as ``progress(pages_done, pages_total)``.
        on_page: called as ``on_page(document, page)`` with each page as it comes, before its
            image and crops are released (a writer of the result bundle writes its crops then).

    Returns:
        The ``Document`` (no page images) and the layout overlays (empty unless asked for).

    Raises:
        InputError: the document cannot be opened. TraceError: the trace does not fit it.
    """
    start = time.perf_counter()
    limits = _limits(parser.options)
    with open_document(
        request.data, pages=request.pages, password=request.password, decode_first=False, **limits
    ) as opened:
        total = len(opened.page_indices)
        info = InputInfo.from_opened(opened)
    document = Document(opened.name, metadata=parser.result_metadata(info))
    overlays: list[dict] = []
    if progress is not None:
        progress(0, total)
    pages = parser.iter_pages(
        request.data,
        pages=request.pages,
        password=request.password,
        replay=request.trace,
        keep_page_images="layout" in request.formats,
    )
    for page in pages:
        if on_page is not None:
            on_page(document, page)
        if page.image is not None:
            overlays.append(_overlay_jpeg(page))
            page.image = None
        page.crops = {}
        document.pages.append(page)
        trim_heap()
        if progress is not None:
            progress(len(document.pages), total)
    document.add_page_totals()
    document.timings["wall"] = time.perf_counter() - start
    return document, overlays


def _overlay_jpeg(page: Page) -> dict:
    """A page's layout overlay as a base64 JPEG (long side at most ``OVERLAY_MAX_SIDE``)."""
    image = layout_overlay(page)
    image.thumbnail((OVERLAY_MAX_SIDE, OVERLAY_MAX_SIDE))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return {
        "page_idx": page.index,
        "media_type": "image/jpeg",
        "width": image.width,
        "height": image.height,
        "data": data,
    }


def render_result(document: Document, formats: frozenset[str], overlays: list[dict] | None = None) -> dict:
    """The JSON-ready result of a parse: status, metadata (``Document.metadata``), structured errors,
    per-page summary, timings (seconds), counts (tokens), asked-for parts
    (``overlays``: the pages' layout overlays from ``run_parse``, returned for ``layout``)."""
    result: dict = {
        "status": document.status,
        "metadata": document.metadata,
        "errors": [e.to_dict() for e in document.errors],
        "page_count": len(document.pages),
        "pages": [
            {
                "page_idx": p.index,
                "status": p.status,
                "size": list(p.size),
                "errors": [e.to_dict() for e in p.errors],
                "warnings": p.warnings,
            }
            for p in document.pages
        ],
        "timings": document.timings,
        "counts": document.counts,
    }
    if "markdown" in formats:
        result["markdown"] = document.to_markdown()
    if "middle_json" in formats:
        result["middle_json"] = document.to_middle_json()
    if "structured_content" in formats:
        result["structured_content"] = document.to_structured_content()
    if "content_list" in formats:
        result["content_list"] = document.to_content_list()
    if "json" in formats:
        result["document"] = document.to_dict()
    if "layout" in formats:
        result["layout"] = overlays or []
    return result


def canary_image() -> Image.Image:
    """A small page drawn with Pillow (a title, lines of text, a ruled table): the canary page."""
    page = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(page)
    draw.text((40, 30), "mineru-fast canary page", fill="black", font=ImageFont.load_default(size=28))
    font = ImageFont.load_default(size=16)
    for i in range(6):
        draw.text(
            (40, 90 + 26 * i), f"Line {i + 1}: the quick brown fox jumps over the lazy dog.", fill="black", font=font
        )
    for r in range(4):
        draw.line((40, 280 + 36 * r, 600, 280 + 36 * r), fill="black", width=2)
    for c in range(4):
        draw.line((40 + 186 * c, 280, 40 + 186 * c, 388), fill="black", width=2)
    return page


# What the canary page holds, as MinerU2.5's outputs for it: replayed, so the start-up check runs
# every stage (vision, prefill, decode, the protocol, post-processing) whatever the weights are.
CANARY_TRACE = PageTrace(
    "<|box_start|>062 062 700 130<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>\n"
    "<|box_start|>062 180 940 560<|box_end|><|ref_start|>text<|ref_end|><|rotate_up|>\n"
    "<|box_start|>062 580 940 810<|box_end|><|ref_start|>table<|ref_end|><|rotate_up|>",
    [
        "mineru-fast canary page",
        "Line 1: the quick brown fox jumps over the lazy dog.",
        "<ecel><ecel><ecel><nl><ecel><ecel><ecel><nl><ecel><ecel><ecel><nl>",
    ],
)


def run_canary(parser: DocumentParser) -> dict:
    """Parse ``canary_image()`` once, replaying ``CANARY_TRACE`` (on the standard tier also its
    layout, as PP-DocLayoutV2 detections): warms the models up and proves the whole pipeline
    works (a replayed page costs what decoding it costs: about a minute for the full-size model
    on 2 cores, most of it the 1036x1036 layout pass). The service runs it before or after it
    becomes ready, or not at all (``ServeConfig.canary``; ``startup.Canary``).

    Returns:
        ``{"status", "seconds", "blocks"}`` of the canary parse.

    Raises:
        RuntimeError: the canary page did not parse.
    """
    from mineru_fast.protocol.layout_trace import LayoutTrace

    trace = Trace([CANARY_TRACE])
    layouts = LayoutTrace.from_trace(trace) if parser.tier == "standard" else None  # PP-DocLayoutV2 replayed too
    start = time.perf_counter()
    document = parser.parse(canary_image(), replay=trace, layout_replay=layouts)
    seconds = time.perf_counter() - start
    if document.status != "success":
        notes = [e.message for p in document.pages for e in p.errors] + [w for p in document.pages for w in p.warnings]
        problems = "; ".join(notes) or "; ".join(e.message for e in document.errors)
        raise RuntimeError(f"the canary page failed to parse: {problems}")
    return {
        "status": document.status,
        "seconds": round(seconds, 3),
        "blocks": sum(len(p.blocks) for p in document.pages),
    }
