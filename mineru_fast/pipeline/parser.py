"""``DocumentParser``: the one entry point. Source in, pages (streamed) or a ``Document`` out.

Per page on the ``advanced`` tier: render -> layout request (1036x1036, "Layout Detection:") ->
blocks -> one content request per readable block (crop of the full-resolution page) ->
post-processing -> ``Page``. On the ``standard`` tier the layout comes from PP-DocLayoutV2 (run on
the pages that joined the window together), text-like blocks take the PDF's text where the text
layer is trusted (``standard.plan_page``), and only the other blocks (and inline formulas) become
content requests; the same post-processing and writer follow.
Requests go to the engine's shared loop as soon as they exist (a page's crops join the batch the
moment its layout is read), so pages of one document, and the documents of concurrent callers,
decode together. At most ``page_window`` pages of a document are in flight; each page leaves the
parser once it is done and yielded. A page that fails is a page result; the other pages go on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from mineru_fast.engine.base import GenerationRequest, GenerationResult, RequestHandle
from mineru_fast.engine.interface import Engine
from mineru_fast.errors import InputError, MineruFastError, TraceError
from mineru_fast.inputs.documents import OpenedDocument, PageLimits, Source, open_document
from mineru_fast.inputs.pdftext import PageText, block_text
from mineru_fast.layout import LayoutDetector
from mineru_fast.layout import PageLayout as DetectedLayout
from mineru_fast.options import ParserOptions
from mineru_fast.pipeline.standard import (
    INLINE_FORMULA_TYPE,
    TEXT_FROM_PDF,
    PagePlan,
    pdf_contents,
    plan_page,
    protocol_layout,
)
from mineru_fast.protocol.layout_trace import LayoutTrace, load_layout_trace
from mineru_fast.protocol.page import ContentOutput, PageLayout, layout_from_blocks, plan_content, read_layout
from mineru_fast.protocol.spec import LAYOUT_TASK, detect_model_version, layout_image, prompt_for
from mineru_fast.protocol.traces import PageTrace, Trace, load_trace
from mineru_fast.results.document import Document
from mineru_fast.results.finish import finish_blocks
from mineru_fast.results.metadata import PACKAGE, SCHEMA_VERSION, InputInfo
from mineru_fast.results.page import Page, ParseError, cut_crops
from mineru_fast.runtime.hub import DEFAULT_MODEL_ID, ModelInfo, resolve_model_info

logger = logging.getLogger(__name__)

__all__ = ["DocumentParser", "CUT_REASONS"]

CUT_REASONS = ("length", "repetition", "timeout", "cancelled")
"""Finish reasons of an output that ended before the model did: the block's text may be incomplete."""


def _add_result(page: Page, result: GenerationResult, speculative: bool) -> None:
    """Add a request's seconds to the page's timings and its tokens to the page's counts (with
    ``speculative``, its decode steps and its drafts' tokens too)."""
    for key, value in (("vision", result.vision_s), ("prefill", result.prefill_s), ("decode", result.decode_s)):
        page.timings[key] = page.timings.get(key, 0.0) + value
    counts = {"requests": 1, "prompt_tokens": result.prompt_tokens, "generated_tokens": len(result.token_ids)}
    if speculative:
        counts |= {
            "decode_steps": result.decode_steps,
            "draft_tokens": result.draft_tokens,
            "accepted_tokens": result.accepted_tokens,
        }
    for name, count in counts.items():
        page.counts[name] = page.counts.get(name, 0) + count


class _EngineFailure(MineruFastError):
    """The engine answered a request with ``finish_reason="error"``."""

    code = "engine_error"


@dataclass(eq=False)
class _PageWork:
    """A page in flight: its trace, its layout request (advanced) or detection (standard), then its
    content requests (and, on the standard tier, its inline-formula requests)."""

    page: Page
    trace: PageTrace | None
    layout: RequestHandle | None = None
    layout_read: bool = False
    page_layout: PageLayout | None = None
    contents: dict[int, RequestHandle] = field(default_factory=dict)  # block index -> request
    done: bool = False
    awaiting_detection: bool = False  # standard tier: rendered, layout model not run yet
    page_text: PageText | None = None  # the page's text layer: standard tier "txt" documents; advanced tier drafts
    plan: PagePlan | None = None  # standard tier: what the PDF filled and what the VLM reads
    formulas: dict[int, RequestHandle] = field(default_factory=dict)  # inline formula index -> request

    def handles(self) -> list[RequestHandle]:
        own = [self.layout] if self.layout is not None else []
        return own + list(self.contents.values()) + list(self.formulas.values())


class _ImagePages:
    """A list of PIL images as one document (``OpenedDocument``'s reading interface)."""

    def __init__(self, images: list[Image.Image], limits: PageLimits) -> None:
        self.name, self.format, self.sha256, self.images, self.limits = "document", "images", None, images, limits
        self.page_count = len(images)
        self.page_indices = list(range(len(images)))

    def render(self, index: int) -> Image.Image:
        with open_document(self.images[index], **self.limits) as opened:
            return opened.render(0)

    def __enter__(self) -> _ImagePages:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def text_layer_mode(self, ocr_mode: str) -> tuple[str, str]:
        """Images have no text layer: always ``"ocr"``."""
        return "ocr", "an image has no text layer"

    def page_text(self, index: int) -> None:
        return None


def _replayed(content: str | None, task: str, replaying: bool) -> str | None:
    """The output a replayed request is forced to: the trace's content; for an image analysis
    (Pro-2605) the trace has no content for, the empty answer (traces recorded for 2509, which
    leaves images unread, and OmniDocBench's hold none; official MinerU replayed the same way
    answers an empty string). None: nothing to force (decoded)."""
    if content is None and replaying and task == "image":
        return ""
    return content


class DocumentParser:
    """Parses PDFs and images with a MinerU2.5 model.

    Build it with ``from_pretrained``; then ``parse`` one document, stream its pages with
    ``iter_pages``, or stream many documents with ``parse_many``. Thread-safe without a lock:
    concurrent calls from several threads share the engine's batch (that is what makes them
    faster together than one after another).

    Args:
        engine: an inference engine (see ``mineru_fast.engine``).
        options: the options it was built with.
        model_dir: the checkpoint directory, for reference.
        model_info: which checkpoint this is (hub id, revision, commit); default: read from
            ``model_dir`` (``ModelInfo.from_dir``).
        layout_detector: PP-DocLayoutV2 for the standard tier; None loads it from
            ``options.layout_model`` / ``options.layout_backend`` when the tier is ``standard``.

    Raises:
        LayoutModelMissing: the standard tier and no PP-DocLayoutV2 weights found (the message
            says what to download and where it looked); never a silent switch to ``advanced``.
    """

    def __init__(
        self,
        engine: Engine,
        options: ParserOptions,
        model_dir: Path,
        model_info: ModelInfo | None = None,
        layout_detector: LayoutDetector | None = None,
        *,
        download: bool = True,
    ) -> None:
        self.engine = engine
        self.options = options
        self.model_dir = model_dir
        self.model_info = model_info if model_info is not None else ModelInfo.from_dir(model_dir)
        self.model_version = detect_model_version(model_dir, options.model_version)
        self.image_analysis = options.resolved_image_analysis(self.model_version)
        self.tier = options.resolved_tier
        if self.tier == "standard" and layout_detector is None:
            layout_detector = LayoutDetector.from_pretrained(
                options.layout_model,
                backend=options.layout_backend,
                threads=options.threads,
                batch_size=options.page_window,
                download=download,
            )
        self.layout_detector = layout_detector if self.tier == "standard" else None
        self._detect_lock = threading.Lock()  # one detection at a time per detector

    @functools.cached_property
    def runtime(self) -> dict[str, Any]:
        """What the engine runs on this machine and why (``engine.numerics.describe``: ISA class, precision,
        bfloat16 native or emulated, INT8 kernel and the reason for it, and, as the engine was
        built, what runs the language model's block-wise INT8, ``lm_int8_block``, or its per-channel
        INT8 decode rows, ``lm_decode_kernel``, the vision attention, ``vision_attention``, and the
        language model's decode attention, ``lm_decode_attention``);
        JSON-ready."""
        from mineru_fast.engine.numerics import describe

        built = getattr(self.engine, "numerics", None)
        return dict(built) if built else describe(self.options)

    def result_metadata(self, source: InputInfo | None) -> dict[str, Any]:
        """The metadata block of a result of this parser (see ``results.metadata``).

        Args:
            source: the input (``InputInfo.from_opened(open_document(...))``); None if it could not
                be opened.

        Returns:
            A JSON-ready dict in the schema's key order: schema version, package, input, model
            (hub id, revision, commit, folder name, protocol version), ``tier`` (the tier this
            parser runs, ``ParserOptions.resolved_tier``), options and ``runtime`` (``self.runtime``).
        """
        info = self.model_info
        return {
            "schema_version": SCHEMA_VERSION,
            "package": dict(PACKAGE),
            "input": source.to_dict() if source is not None else None,
            "model": {
                "model_id": info.model_id,
                "revision": info.revision,
                "commit": info.commit,
                "name": info.local_dir.name,
                "protocol_version": self.model_version,
            },
            "tier": self.tier,
            "options": self.options.to_dict(),
            "runtime": self.runtime,
        }

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path = DEFAULT_MODEL_ID,
        options: ParserOptions | None = None,
        *,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        token: str | bool | None = None,
        local_files_only: bool | None = None,
        prepared_cache: bool | None = None,
    ) -> DocumentParser:
        """Load a MinerU2.5 checkpoint from a local directory or a Hugging Face hub id.

        Args:
            path_or_id: model directory, hub id (default ``opendatalab/MinerU2.5-Pro-2605-1.2B``,
                MinerU 4's model) or a version name of ``hub.MODEL_IDS`` (``"2509"``), looked up in
                the local hub cache before any download.
            options: parser options; default ``ParserOptions()``.
            revision: branch, tag or commit hash of a hub id; None = the default branch.
            cache_dir: Hugging Face hub cache; None = huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME``).
            token: hub token for private or gated models; None = ``HF_TOKEN`` or the stored login.
            local_files_only: never download; None follows ``HF_HUB_OFFLINE``.
            prepared_cache: keep the fast engine's quantized model in the package cache
                (``hub.cache_dir() / "prepared"``, about 1.3 GB per checkpoint and settings) and load
                it from there at the next start (see ``engine.prepared``); None = yes unless
                ``$MINERU_FAST_PREPARED_CACHE`` is ``0``/``off``; False never reads or writes it.

        Returns:
            The parser; ``parser.model_info`` says which checkpoint (hub id, revision, commit) it runs.

        Raises:
            ModelNotCached: offline and the model or revision is not cached (says what is missing).
            ModelLoadError: the model cannot be found or loaded (the message says how to fix it).
            LayoutModelMissing: ``tier="standard"`` and PP-DocLayoutV2 is not found (checked
                before the VLM is loaded).
        """
        from mineru_fast.engine.factory import build_engine

        options = options or ParserOptions()
        detector = None
        if options.resolved_tier == "standard":
            detector = LayoutDetector.from_pretrained(
                options.layout_model,
                backend=options.layout_backend,
                threads=options.threads,
                batch_size=options.page_window,
                download=not local_files_only,
            )
        info = resolve_model_info(
            path_or_id, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only
        )
        engine = build_engine(info.local_dir, options, prepared_cache)
        return cls(engine, options, info.local_dir, info, detector)

    def close(self) -> None:
        """Stop the engine loop (requests still running end ``cancelled``)."""
        self.engine.close()

    def __enter__(self) -> DocumentParser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ------------------------------------------------------------------------------

    def parse(
        self,
        source: Source | list[Image.Image],
        *,
        pages: str | None = None,
        password: str | None = None,
        replay: Trace | str | Path | None = None,
        keep_page_images: bool = False,
        layout_replay: LayoutTrace | str | Path | None = None,
    ) -> Document:
        """Parse one document.

        Args:
            source: file path, bytes, a PIL image, or a list of PIL images (the pages of one
                document).
            pages: 1-based page range such as ``"1-3,5"``; None parses every page.
            password: user password of an encrypted PDF.
            replay: a trace (or its path) whose outputs are forced instead of decoded (benchmarks,
                pipeline tests); see ``mineru_fast.protocol.traces``.
            keep_page_images: keep each rendered page on ``Page.image`` (layout overlays need
                it); by default only the crops the outputs use are kept (``Page.crops``).
            layout_replay: standard tier: PP-DocLayoutV2 detections (or their path) to use instead
                of the model's (the model still runs); see ``protocol.layout_trace``. On this tier a
                ``replay`` trace's contents are matched to the detected blocks by box
                (``PageTrace.content_near``).

        Returns:
            The ``Document``; per-page failures are in ``page.errors`` and ``document.status``.

        Raises:
            InputError: the document cannot be opened (format, password, corruption, page range).
            TraceError: a replay trace is unreadable or has fewer pages than the document, or a
                ``layout_replay`` on the advanced tier.
        """
        start = time.perf_counter()
        info, collected = None, []
        for page in self._iter_pages(source, pages, password, replay, keep_page_images, layout_replay):
            if isinstance(page, Page):
                collected.append(page)
            else:  # the opened document, yielded first (and still open)
                info = InputInfo.from_opened(page)
        assert info is not None  # _iter_pages yields the document first
        document = Document(info.name, pages=collected, metadata=self.result_metadata(info))
        document.add_page_totals()
        document.timings["wall"] = time.perf_counter() - start
        return document

    def iter_pages(
        self,
        source: Source | list[Image.Image],
        *,
        pages: str | None = None,
        password: str | None = None,
        replay: Trace | str | Path | None = None,
        keep_page_images: bool = False,
        layout_replay: LayoutTrace | str | Path | None = None,
    ) -> Iterator[Page]:
        """Parse one document page by page, yielding each ``Page`` (in page order) as soon as it
        and the pages before it are done. The document is opened once; at most ``page_window``
        pages are rendered and in flight at a time, and nothing of a yielded page stays in the
        parser, so memory stays flat in the page count. A page that fails is yielded with status
        ``failure``. Closing the iterator early cancels the pages still in flight.

        Arguments and errors as ``parse``; errors are raised on the first ``next()``.
        """
        for page in self._iter_pages(source, pages, password, replay, keep_page_images, layout_replay):
            if isinstance(page, Page):
                yield page

    def parse_many(self, sources: Iterable[Source], **kwargs: object) -> Iterator[Document]:
        """Parse documents one after another, yielding each when done.

        A document that cannot be opened is yielded as a ``failure`` Document carrying the error,
        so one bad input never stops the stream. Keyword arguments go to ``parse``.
        """
        for source in sources:
            try:
                yield self.parse(source, **kwargs)  # type: ignore[arg-type]
            except InputError as exc:
                name = Path(source).stem if isinstance(source, (str, Path)) else "document"
                yield Document(name, errors=[ParseError.from_exception(exc)], metadata=self.result_metadata(None))

    # -- the page pipeline -----------------------------------------------------------------------

    def _iter_pages(
        self,
        source: Source | list[Image.Image],
        pages: str | None,
        password: str | None,
        replay: Trace | str | Path | None,
        keep_page_images: bool,
        layout_replay: LayoutTrace | str | Path | None = None,
    ) -> Iterator[Page | OpenedDocument | _ImagePages]:
        """Yields the opened document first (``parse`` describes it, ``InputInfo.from_opened``, while
        it is open; ``iter_pages`` reads nothing more of it), then its pages."""
        trace = load_trace(replay) if isinstance(replay, (str, Path)) else replay
        layouts = load_layout_trace(layout_replay) if isinstance(layout_replay, (str, Path)) else layout_replay
        if layouts is not None and self.tier != "standard":
            raise TraceError("a layout replay applies to tier 'standard' (PP-DocLayoutV2 detections)")
        o = self.options
        limits = PageLimits(
            dpi=o.dpi, max_side=o.max_side, max_pixels=o.max_image_pixels, render_timeout=o.render_timeout
        )
        opened: _ImagePages | OpenedDocument
        if isinstance(source, list):
            opened = _ImagePages(source, limits)
        else:
            opened = open_document(source, pages=pages, password=password, max_pages=o.max_pages, **limits)
        with opened:
            if trace is not None and len(trace.pages) < opened.page_count:
                raise TraceError(f"trace has {len(trace.pages)} pages, {opened.name} has {opened.page_count}")
            if layouts is not None and len(layouts.pages) < opened.page_count:
                raise TraceError(f"layout trace has {len(layouts.pages)} pages, {opened.name} has {opened.page_count}")
            text_mode = opened.text_layer_mode(o.ocr_mode) if self.tier == "standard" else None
            yield opened
            progress = self._progress(len(opened.page_indices), opened.name)
            try:
                for page in self._run_pages(opened, trace, keep_page_images, layouts, text_mode):
                    progress.update(1)
                    yield page
            finally:
                progress.close()

    def _run_pages(
        self,
        opened,
        trace: Trace | None,
        keep_page_images: bool,
        layouts: LayoutTrace | None = None,
        text_mode: tuple[str, str] | None = None,
    ) -> Iterator[Page]:
        """Render pages into a window of at most ``page_window``, submit their requests (standard
        tier: detect the layouts of the pages that joined, together), advance each page as its
        requests finish, yield pages in order."""
        indices = iter(opened.page_indices)
        window: deque[_PageWork] = deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(window) < self.options.page_window:
                    index = next(indices, None)
                    if index is None:
                        exhausted = True
                        break
                    window.append(self._start_page(opened, index, trace, text_mode))
                fresh = [work for work in window if work.awaiting_detection]
                if fresh:
                    self._detect(fresh, layouts, text_mode)
                if not window:
                    return
                if window[0].done:
                    work = window.popleft()
                    self._finish_page(work, keep_page_images)
                    yield work.page
                    continue
                self._advance(window)
        finally:
            for work in window:  # an abandoned iterator: stop what is still running
                for handle in work.handles():
                    handle.cancel()

    def _submit(self, request: GenerationRequest) -> RequestHandle:
        """``request`` to the engine, with the options' speculative decoding."""
        if self.options.speculative:
            request = dataclasses.replace(request, speculative=self.options.speculative)
        return self.engine.submit(request)

    def _start_page(self, opened, index: int, trace: Trace | None, text_mode: tuple[str, str] | None) -> _PageWork:
        page = Page(index, tier=self.tier)
        work = _PageWork(page, self._page_trace(trace, index))
        start = time.perf_counter()
        try:
            page.image = opened.render(index)
            page.size = page.image.size
        except InputError as exc:
            page.status, page.errors = "failure", [ParseError.from_exception(exc, index)]
            work.done = True
        page.timings["render"] = time.perf_counter() - start
        if self.tier == "standard":
            if page.image is not None:
                work.awaiting_detection = True
                if text_mode is not None and text_mode[0] == "txt":
                    start = time.perf_counter()
                    try:
                        work.page_text = opened.page_text(index)
                    except InputError as exc:  # an unreadable text layer: the page is read from its image
                        page.warnings.append(f"text layer not read ({exc}); page read from its image")
                    chars = work.page_text.chars if work.page_text is not None else []
                    if hidden := sum(c.hidden or c.white for c in chars):
                        warning = (f"{hidden} invisible or white characters in the text layer: invisible ones "
                                   "left out, a block holding white text read from the page image")  # fmt: skip
                        logger.warning("page %d: %s", index + 1, warning)
                        page.warnings.append(warning)
                    page.timings["text_layer"] = time.perf_counter() - start
            return work
        page.ocr_mode, page.ocr_reason = "ocr", "the advanced tier reads every block from the page image"
        if page.image is not None and self.options.speculative:
            try:  # drafts for the text blocks (speculative decoding); None for an image
                work.page_text = opened.page_text(index)
            except Exception as exc:  # drafts are optional: the page is read from its image as without them
                logger.warning("page %d: text layer not read for drafts (%s: %s)", index + 1, type(exc).__name__, exc)
        if page.image is not None:
            request = GenerationRequest(
                layout_image(page.image),
                prompt_for(LAYOUT_TASK),
                self.options.sampling(LAYOUT_TASK, replayed=work.trace is not None),
                forced_text=work.trace.layout if work.trace else None,
            )
            try:
                work.layout = self._submit(request)
            except Exception as exc:  # engines report failures as results; this guards a broken one
                logger.exception("page %d: the engine refused its layout request", index + 1)
                page.status, page.errors = "failure", [ParseError.from_exception(exc, index, "engine_error")]
                work.done = True
        return work

    def _advance(self, window: deque[_PageWork]) -> None:
        """Wait until some request of the window finishes, then move its page forward."""
        owner = {h.future: w for w in window if not w.done for h in w.handles() if not h.done()}
        if owner:
            concurrent.futures.wait(owner, return_when=concurrent.futures.FIRST_COMPLETED)
        for work in window:
            if work.done:
                continue
            try:
                if not work.layout_read and work.layout is not None and work.layout.done():
                    work.layout_read = True
                    self._read_layout(work)
                if work.layout_read and all(h.done() for h in [*work.contents.values(), *work.formulas.values()]):
                    self._read_contents(work)
                    work.done = True
            except Exception as exc:  # a broken page fails alone; the document goes on
                logger.exception("page %d failed", work.page.index + 1)
                self._fail(work, exc)

    def _detect(self, works: list[_PageWork], layouts: LayoutTrace | None, text_mode: tuple[str, str] | None) -> None:
        """Standard tier: PP-DocLayoutV2 over the pages that joined the window (one batched call),
        then each page's plan and its VLM requests. A page whose planning fails fails alone."""
        assert self.layout_detector is not None and text_mode is not None
        images = [work.page.image for work in works]
        replay = [layouts.pages[work.page.index] for work in works] if layouts is not None else None
        start = time.perf_counter()
        try:
            with self._detect_lock:
                detected = self.layout_detector.detect(images, replay)  # type: ignore[arg-type]
        except Exception as exc:  # the detector failed on this window: its pages fail, the document goes on
            logger.exception("layout detection failed on pages %s", [w.page.index + 1 for w in works])
            for work in works:
                self._fail(work, exc)
            return
        share = (time.perf_counter() - start) / len(works)
        for work, layout in zip(works, detected, strict=True):
            work.awaiting_detection = False
            work.page.timings["layout_model"] = share
            try:
                self._plan_standard(work, layout, text_mode)
            except Exception as exc:
                logger.exception("page %d failed", work.page.index + 1)
                self._fail(work, exc)

    def _plan_standard(self, work: _PageWork, layout: DetectedLayout, text_mode: tuple[str, str]) -> None:
        """A detected layout -> the page's plan (``standard.plan_page``), its protocol layout, and
        the content requests of the blocks the PDF did not fill, then of its inline formulas."""
        page, trace = work.page, work.trace
        assert page.image is not None
        plan = plan_page(layout, work.page_text, text_mode[0], self.image_analysis)
        work.page_text = None
        page.ocr_mode = plan.mode
        page.ocr_reason = text_mode[1] if text_mode[0] == "ocr" else plan.reason
        work.plan, work.page_layout, work.layout_read = plan, protocol_layout(plan), True
        filled = {i for i, block in enumerate(plan.blocks) if block.content is not None}
        requests = plan_content(page.image, work.page_layout, image_analysis=self.image_analysis)
        if len(work.page_layout.blocks) != len(plan.blocks):  # only image_caption blocks are dropped there
            raise RuntimeError("the protocol dropped blocks of a detected layout")
        for request in requests:
            if request.block_index in filled:
                continue
            block = plan.blocks[request.block_index]
            forced = trace.content_near(block.type, block.bbox) if trace is not None else None
            forced = _replayed(forced, request.task, trace is not None)
            if trace is not None and forced is None:
                page.warnings.append(f"trace has no content for block {request.block_index}; it is decoded")
            work.contents[request.block_index] = self._submit(
                GenerationRequest(
                    request.image,
                    request.prompt,
                    self.options.sampling(request.task, replayed=forced is not None),
                    forced,
                )
            )
        formulas = [read for read in plan.reads if read.formula is not None]
        if formulas:
            boxes = layout_from_blocks([(INLINE_FORMULA_TYPE, read.bbox, 0, None) for read in formulas])
            for request in plan_content(page.image, boxes, image_analysis=False):
                formula = formulas[request.block_index].formula
                assert formula is not None
                work.formulas[formula] = self._submit(
                    GenerationRequest(request.image, request.prompt, self.options.sampling(INLINE_FORMULA_TYPE))
                )

    @staticmethod
    def _fail(work: _PageWork, exc: Exception) -> None:
        """Mark a page ``failure`` with the error, cancel its requests (the others go on)."""
        page = work.page
        error = ParseError.from_exception(exc, page.index)
        page.status, page.errors, page.blocks = "failure", [*page.errors, error], []
        for handle in work.handles():
            handle.cancel()
        work.awaiting_detection, work.done = False, True

    def _read_layout(self, work: _PageWork) -> None:
        """The page's layout result -> its layout (``protocol.page.read_layout``) and the content
        requests of the blocks the protocol reads. Garbage, dropped lines, unknown types and a cut
        layout make the page ``failure`` / ``partial`` with warnings, never a quiet success."""
        page, trace = work.page, work.trace
        assert work.layout is not None and page.image is not None
        layout = work.layout.result()
        _add_result(page, layout, self.options.speculative > 0)
        if layout.finish_reason == "error":
            raise _EngineFailure(f"layout step failed: {layout.error}")
        page.layout_raw = layout.text
        work.page_layout = page_layout = read_layout(layout.text)
        page.warnings.extend(page_layout.warnings)
        if layout.finish_reason in CUT_REASONS:
            page.warnings.append(f"layout output was cut ({layout.finish_reason}); later blocks may be missing")
        if not page_layout.blocks and layout.text.strip():
            page.status = "failure"
            page.errors.append(ParseError("layout_unreadable", "layout output holds no valid block", page.index))
        elif page.warnings:
            page.status = "partial"
        for request in plan_content(page.image, page_layout, image_analysis=self.image_analysis):
            forced = None
            if trace is not None:
                forced = _replayed(trace.content_for(page_layout.blocks[request.block_index]), request.task, True)
                if forced is None:
                    page.warnings.append(f"trace has no content for block {request.block_index}; it is decoded")
            sampling = self.options.sampling(request.task, replayed=forced is not None)
            draft = _draft_text(work.page_text, page_layout.blocks[request.block_index])
            work.contents[request.block_index] = self._submit(
                GenerationRequest(request.image, request.prompt, sampling, forced, draft_text=draft)
            )
        work.page_text = None

    def _read_contents(self, work: _PageWork) -> None:
        """Content results -> final blocks (``results.finish.finish_blocks``); cut or failed blocks
        make the page ``partial``."""
        page = work.page
        outputs: dict[int, ContentOutput] = {}
        assert work.page_layout is not None
        for i, handle in work.contents.items():
            result = handle.result()
            _add_result(page, result, self.options.speculative > 0)
            logprobs = result.logprobs
            if logprobs and result.finish_reason == "stop":  # the end token is no part of the block's text
                logprobs = logprobs[:-1]
            outputs[i] = ContentOutput(result.text, result.finish_reason, result.error, logprobs)
            if result.finish_reason in CUT_REASONS:
                kind = work.page_layout.blocks[i]["type"]
                page.warnings.append(f"block {i} ({kind}) was cut: {result.finish_reason}")
        filled = None
        if work.plan is not None:  # standard tier: the PDF's text, inline formulas spliced in
            formula_outputs: dict[int, str | None] = {}
            for k, handle in work.formulas.items():
                result = handle.result()
                _add_result(page, result, self.options.speculative > 0)
                formula_outputs[k] = result.text if result.finish_reason != "error" else None
                if result.finish_reason in CUT_REASONS or result.finish_reason == "error":
                    page.warnings.append(f"inline formula {k} was not read in full: {result.finish_reason}")
            filled = pdf_contents(work.plan, formula_outputs)
        page.blocks = finish_blocks(work.page_layout, outputs, filled)
        threshold = self.options.confidence_threshold
        if threshold is not None:
            for block in page.blocks:
                confidence = block.confidence
                block.low_confidence = confidence is not None and confidence.mean_logprob < threshold
        if page.status == "success" and any(b.error or b.finish_reason in CUT_REASONS for b in page.blocks):
            page.status = "partial"

    def _finish_page(self, work: _PageWork, keep_page_images: bool) -> None:
        """Cut the crops the outputs reference and, unless asked to keep it, drop the page image."""
        from mineru_fast.results.writer import render_page

        page = work.page
        if page.image is not None and page.status != "failure":
            page.crops = cut_crops(page, render_page(page).crops)
        if not keep_page_images:
            page.image = None
        stages = ("render", "text_layer", "layout_model", "vision", "prefill", "decode")
        page.timings["total"] = sum(page.timings.get(k, 0.0) for k in stages)

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


def _draft_text(page_text: PageText | None, block: dict) -> str | None:
    """The text layer's text of a text-like ``block`` (``read_layout``'s form: ``type``,
    normalized ``bbox``) as drafts for its recognition, or None: no text layer, another type, no
    characters there, text ``block_text`` does not trust (white or hidden text), or text it could
    not assemble (logged: drafts are optional, the block is read as without them)."""
    if page_text is None or block["type"] not in TEXT_FROM_PDF:
        return None
    try:
        assembled = block_text(page_text, tuple(block["bbox"]))
    except Exception as exc:
        logger.warning("no drafts for a %s block (%s: %s)", block["type"], type(exc).__name__, exc)
        return None
    return assembled.text if assembled.chars and not assembled.suspicious else None
