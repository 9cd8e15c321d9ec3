"""``DocumentParser``: the one entry point. Source in, ``Document`` out.

Per page: render -> layout request (1036x1036, "Layout Detection:") -> blocks -> one content
request per readable block (crop of the full-resolution page) -> post-processing -> ``Page``.
The pages of a window share one engine call: each page's crops join the batch as soon as its
layout is read.
A page that fails is reported on its own and the other pages go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from PIL import Image

from .document import Document, Page
from .engine.base import Engine, GenerationRequest, GenerationResult
from .errors import InputError, TraceError
from .hub import DEFAULT_MODEL_ID, resolve_model
from .inputs import OpenedDocument, Source, open_document
from .options import ParserOptions
from .page_protocol import ContentOutput, PageLayout, finish_blocks, plan_content, read_layout
from .protocol import LAYOUT_TASK, detect_model_version, layout_image, prompt_for
from .traces import PageTrace, Trace, load_trace

logger = logging.getLogger(__name__)

__all__ = ["DocumentParser"]


def _add_timings(timings: dict[str, float], results: Iterable[GenerationResult]) -> None:
    for r in results:
        timings["vision"] = timings.get("vision", 0.0) + r.vision_s
        timings["prefill"] = timings.get("prefill", 0.0) + r.prefill_s
        timings["decode"] = timings.get("decode", 0.0) + r.decode_s
        timings["tokens"] = timings.get("tokens", 0) + len(r.token_ids)


class DocumentParser:
    """Parses PDFs and images into ``Document`` objects with a MinerU2.5 model.

    Build it with ``from_pretrained``; then ``parse`` one document or stream many with
    ``parse_many``. Thread-safe: concurrent ``parse`` calls take turns on the engine (one lock),
    so they are correct but not faster than calling one after another.

    Args:
        engine: an inference engine (see ``mineru_fast.engine``).
        options: the options it was built with.
        model_dir: the checkpoint directory, for reference.
    """

    def __init__(self, engine: Engine, options: ParserOptions, model_dir: Path) -> None:
        self.engine = engine
        self.options = options
        self.model_dir = model_dir
        self.model_version = detect_model_version(model_dir, options.model_version)
        self.image_analysis = options.resolved_image_analysis(self.model_version)
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls, path_or_id: str | Path = DEFAULT_MODEL_ID, options: ParserOptions | None = None
    ) -> DocumentParser:
        """Load a MinerU2.5 checkpoint from a local directory or a Hugging Face hub id.

        Args:
            path_or_id: model directory, or hub id (default ``opendatalab/MinerU2.5-2509-1.2B``),
                looked up in the local hub cache before any download.
            options: parser options; default ``ParserOptions()``.

        Raises:
            ModelLoadError: the model cannot be found or loaded (the message says how to fix it).
        """
        from .engine.factory import build_engine

        options = options or ParserOptions()
        model_dir = resolve_model(path_or_id)
        engine = build_engine(model_dir, options)
        return cls(engine, options, model_dir)

    def parse(
        self,
        source: Source | list[Image.Image],
        *,
        pages: str | None = None,
        password: str | None = None,
        replay: Trace | str | Path | None = None,
    ) -> Document:
        """Parse one document.

        Args:
            source: file path, bytes, a PIL image, or a list of PIL images (the pages of one
                document).
            pages: 1-based page range such as ``"1-3,5"``; None parses every page.
            password: user password of an encrypted PDF.
            replay: a trace (or its path) whose outputs are forced instead of decoded (benchmarks,
                pipeline tests); see ``mineru_fast.traces``.

        Returns:
            The ``Document``; per-page failures are in ``page.errors`` and ``document.status``.

        Raises:
            InputError: the document cannot be opened (format, password, corruption, page range).
            TraceError: the replay trace is unreadable or has fewer pages than the document.
        """
        trace = load_trace(replay) if isinstance(replay, (str, Path)) else replay
        with self._lock:
            return self._parse(source, pages, password, trace)

    def _parse(
        self, source: Source | list[Image.Image], pages: str | None, password: str | None, trace: Trace | None
    ) -> Document:
        start = time.perf_counter()
        if isinstance(source, list):
            return self._finish(self._parse_images(source, trace), start)
        with open_document(source, pages=pages, password=password, **self._input_limits()) as opened:
            if trace is not None and len(trace.pages) < opened.page_count:
                raise TraceError(f"trace has {len(trace.pages)} pages, {opened.name} has {opened.page_count}")
            document = Document(opened.name)
            progress = self._progress(len(opened.page_indices), opened.name)
            window = self.options.page_window
            for first in range(0, len(opened.page_indices), window):
                indices = opened.page_indices[first : first + window]
                batch = [(self._render(opened, i), self._page_trace(trace, i)) for i in indices]
                self._run_pages(batch)
                document.pages.extend(page for page, _ in batch)
                progress.update(len(indices))
            progress.close()
        return self._finish(document, start)

    def _parse_images(self, images: list[Image.Image], trace: Trace | None) -> Document:
        """Pages given as PIL images: one document, windows of ``page_window`` pages."""
        document = Document("document")
        window = self.options.page_window
        for first in range(0, len(images), window):
            batch = []
            for i in range(first, min(first + window, len(images))):
                with open_document(images[i], **self._input_limits()) as opened:
                    batch.append((self._render(opened, 0, page_index=i), self._page_trace(trace, i)))
            self._run_pages(batch)
            document.pages.extend(page for page, _ in batch)
        return document

    def parse_many(self, sources: Iterable[Source], **kwargs: object) -> Iterator[Document]:
        """Parse documents one after another, yielding each when done (bounded memory).

        A document that cannot be opened is yielded as a ``failure`` Document carrying the error,
        so one bad input never stops the stream. Keyword arguments go to ``parse``.
        """
        for source in sources:
            try:
                yield self.parse(source, **kwargs)  # type: ignore[arg-type]
            except InputError as exc:
                name = Path(source).stem if isinstance(source, (str, Path)) else "document"
                yield Document(name, errors=[f"{type(exc).__name__}: {exc}"])

    def _input_limits(self) -> dict[str, int]:
        o = self.options
        return {"dpi": o.dpi, "max_side": o.max_side, "max_pixels": o.max_image_pixels}

    def _progress(self, total: int, name: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=name, unit="page", disable=not self.options.progress, leave=False)

    @staticmethod
    def _page_trace(trace: Trace | None, index: int) -> PageTrace | None:
        if trace is None:
            return None
        if index >= len(trace.pages):
            raise TraceError(f"trace has no page {index + 1}")
        return trace.pages[index]

    @staticmethod
    def _render(opened: OpenedDocument, index: int, page_index: int | None = None) -> Page:
        page = Page(index if page_index is None else page_index)
        start = time.perf_counter()
        try:
            page.image = opened.render(index)
            page.size = page.image.size
        except InputError as exc:
            page.status, page.errors = "failure", [f"{type(exc).__name__}: {exc}"]
        page.timings["render"] = time.perf_counter() - start
        return page

    def _run_pages(self, batch: list[tuple[Page, PageTrace | None]]) -> None:
        """Layout and content steps for a window of rendered pages, batched across the window.

        If the batch fails as a whole, each page is retried alone, so a broken page fails alone.
        """
        batch = [(page, trace) for page, trace in batch if page.image is not None]
        if not batch:
            return
        try:
            self._layout_and_content(batch)
        except Exception as exc:  # a broken page fails alone; the document goes on
            if len(batch) > 1:
                for item in batch:
                    self._run_pages([item])
                return
            page = batch[0][0]
            logger.exception("page %d failed", page.index + 1)
            page.status, page.errors = "failure", page.errors + [f"{type(exc).__name__}: {exc}"]
            page.blocks = []
        for page, _ in batch:
            stages = ("render", "vision", "prefill", "decode")
            page.timings["total"] = sum(page.timings.get(k, 0.0) for k in stages)

    def _layout_and_content(self, batch: list[tuple[Page, PageTrace | None]]) -> None:
        """One engine call for the window: the layout requests, and each page's crops submitted
        as soon as its layout is read, so they decode alongside the other pages' layouts."""
        layout_requests = [
            GenerationRequest(
                layout_image(page.image),  # type: ignore[arg-type]
                prompt_for(LAYOUT_TASK),
                self.options.sampling(LAYOUT_TASK),
                forced_text=trace.layout if trace else None,
            )
            for page, trace in batch
        ]
        targets: dict[int, tuple[Page, int]] = {}  # engine index of a content request -> block
        layouts: dict[int, PageLayout] = {}  # id(page) -> its layout, read as its layout result arrives
        next_index = len(layout_requests)

        def on_result(index: int, result: GenerationResult) -> list[GenerationRequest]:
            nonlocal next_index
            if index >= len(batch):
                return []
            page, trace = batch[index]
            requests = self._content_requests(page, trace, result, targets, next_index, layouts)
            next_index += len(requests)
            return requests

        results = self.engine.generate(layout_requests, on_result=on_result)
        outputs: dict[int, dict[int, ContentOutput]] = {id(page): {} for page, _ in batch}
        for index, (page, i) in targets.items():
            result = results[index]
            _add_timings(page.timings, [result])
            outputs[id(page)][i] = ContentOutput(result.text, result.finish_reason, result.error)
            if result.finish_reason in ("length", "repetition"):
                kind = layouts[id(page)].blocks[i]["type"]
                page.warnings.append(f"block {i} ({kind}) was cut: {result.finish_reason}")
        for page, _ in batch:
            layout = layouts[id(page)]
            page.blocks = finish_blocks(layout, outputs[id(page)])
            if any(b.error for b in page.blocks) or layout.unknown_types:
                page.status = "partial"

    def _content_requests(
        self,
        page: Page,
        trace: PageTrace | None,
        layout: GenerationResult,
        targets: dict[int, tuple[Page, int]],
        first_index: int,
        layouts: dict[int, PageLayout],
    ) -> list[GenerationRequest]:
        """Read a page's layout result (``layouts[id(page)]``); the requests of the blocks it reads,
        recorded in ``targets`` from ``first_index`` on.

        Raises:
            RuntimeError: the layout request failed (the window is then retried page by page).
        """
        _add_timings(page.timings, [layout])
        if layout.finish_reason == "error":
            raise RuntimeError(f"layout step failed on page {page.index + 1}: {layout.error}")
        page.layout_raw = layout.text
        layouts[id(page)] = page_layout = read_layout(layout.text)
        page.warnings = list(page_layout.warnings)
        if layout.finish_reason in ("length", "repetition"):
            page.warnings.append(f"layout output was cut ({layout.finish_reason}); later blocks may be missing")
        requests = []
        for request in plan_content(page.image, page_layout, image_analysis=self.image_analysis):  # type: ignore[arg-type]
            forced = trace.content_for(page_layout.blocks[request.block_index]) if trace is not None else None
            if trace is not None and forced is None:
                page.warnings.append(f"trace has no content for block {request.block_index}; it is decoded")
            targets[first_index + len(requests)] = (page, request.block_index)
            sampling = self.options.sampling(request.task)
            requests.append(GenerationRequest(request.image, request.prompt, sampling, forced))
        return requests

    @staticmethod
    def _finish(document: Document, start: float) -> Document:
        for page in document.pages:
            for key, value in page.timings.items():
                document.timings[key] = document.timings.get(key, 0.0) + value
        document.timings["wall"] = time.perf_counter() - start
        return document
