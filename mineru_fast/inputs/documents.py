"""Documents in, RGB page images out.

PDFs are rendered with pypdfium2 (200 DPI, long side capped, page ``/Rotate`` honoured, so boxes
refer to the page as displayed); images are decoded with Pillow (EXIF orientation applied; CMYK,
16-bit, palette and alpha converted to RGB on white; each frame of a multi-frame TIFF is a page, an
animated GIF, WebP or PNG is its first frame, with a warning), and only the formats of
``IMAGE_FORMATS``. The format is detected from the content, never from the file name. Pages are
produced lazily, one at a time, so a long PDF never sits in memory as images.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import multiprocessing
import os
import re
import threading
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mineru_fast.errors import (
    CorruptDocument,
    DocumentNotFound,
    ImageTooLarge,
    InputError,
    NativeDocument,
    PageRangeError,
    PasswordRequired,
    RenderTimeout,
    TooManyPages,
    UnsupportedFormat,
)
from mineru_fast.inputs.properties import image_page_points, pdf_page_points, pdf_properties

if TYPE_CHECKING:
    from mineru_fast.inputs.pdftext import PageText

logger = logging.getLogger(__name__)

Source = str | Path | bytes | bytearray | Image.Image

DEFAULT_DPI = 200
DEFAULT_MAX_SIDE = 3500
DEFAULT_MAX_PIXELS = 150_000_000  # Pillow refuses images above 2 * 89,478,485 pixels regardless.
DEFAULT_MAX_PAGES = 10_000  # pages one parse may select (ParserOptions.max_pages); the service's default is 500
IMAGE_FORMATS = ("PNG", "JPEG", "TIFF", "BMP", "GIF", "WEBP", "JPEG2000", "DCX")
"""The Pillow formats an input may be (``Image.open(formats=...)``; JPEG includes its MPO variant).
Any other plugin is never tried: EPS and PostScript would run Ghostscript on the upload, and the
rarer formats' decoders are attack surface the product does not need."""
_PDFIUM_PASSWORD_ERROR = 4  # FPDF_ERR_PASSWORD
_PDFIUM_LOCK = threading.Lock()  # PDFium is not thread-safe
_MULTI_FRAME_FORMATS = {"TIFF", "MPO", "DCX"}  # multi-page formats: each frame is a page
# Other formats with frames hold animations (GIF, WebP, APNG): the first frame is the page, and a
# warning says the others are dropped. Frames of an animation are drawn over the ones before them,
# so Pillow reaches frame N of a GIF by decoding frames 0..N-1: as pages they could be neither
# counted nor measured from headers alone, as TIFF frames are.
MAX_PAGE_RANGE_CHARS = 4096
MAX_RENDER_TIMEOUTS = 2
"""Pages of one document that may time out rendering (``render_timeout``) before its other pages
fail at once unrendered: a document's pages often share one slow content stream, so without
this bound a document of N such pages held its worker N times ``render_timeout``."""
MAX_IMAGE_FRAMES = 10_000  # pages of one multi-frame image (TIFF, MPO, DCX)
# Peak bytes per pixel that ``OpenedDocument.render`` holds at once for one page, by source: the
# decoded frame, ``to_rgb``'s conversions (an alpha frame is converted to RGBA, composited on a
# white canvas and made RGB, all alive together) and the RGB result, which Pillow stores in 4
# bytes a pixel. Measured with ``benchmarks/decode_memory.py --side 8000`` (peak RSS growth):
# RGBA and LA 24.0, I;16 30.1, I 28.1, F 24.1, RGB and CMYK 12.0, L and P 6.0, a PDF page 8.0, a
# PDF page in a render process (``render_timeout``) 17.0, the child's and this process's together.
_ALPHA_BYTES_PER_PIXEL = 24
_WIDE_BYTES_PER_PIXEL = 31  # I, I;16, F: numpy's float64 scaling
_IMAGE_BYTES_PER_PIXEL = 12  # every other Pillow mode (the largest of them, RGB and CMYK)
_PDF_BYTES_PER_PIXEL = 8  # PDFium's bitmap, its PIL copy, the RGB result
_PDF_PROCESS_BYTES_PER_PIXEL = 17  # the same in the render process, the RGB bytes sent, the image rebuilt here
RGB_BYTES_PER_PIXEL = 4
"""Bytes a rendered page holds per pixel (Pillow keeps RGB in 4 bytes a pixel)."""
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_RANGE_PART = re.compile(r"(\d{1,9})?\s*(?:(-)\s*(\d{1,9})?)?")


class PageLimits(TypedDict):
    """Rendering limits of ``open_document`` (its ``dpi``, ``max_side``, ``max_pixels`` and
    ``render_timeout`` arguments)."""

    dpi: int
    max_side: int
    max_pixels: int
    render_timeout: float | None


def parse_page_range(
    spec: str | None, page_count: int, *, max_pages: int | None = None, notes: list[str] | None = None
) -> list[int]:
    """Turn ``"1-3,5"`` (1-based, inclusive; ``"7-"`` means to the end) into sorted 0-based indices.

    The text is read as intervals (merged, never expanded one page at a time) and refused beyond
    ``MAX_PAGE_RANGE_CHARS`` characters, so a huge value costs nothing; error messages quote at
    most a few characters of it. A range reaching past the document is clamped to it, as MinerU
    and docling do (``"1-3"`` on a 2-page document selects pages 1-2); a part wholly past it is
    dropped; each such change is a warning (logged, and appended to ``notes``).

    Args:
        spec: the range text; None or blank selects every page.
        page_count: pages in the document.
        max_pages: refuse a selection of more pages than this (counted before anything is expanded).
        notes: receives the warnings about clamped or dropped parts.

    Raises:
        PageRangeError: too long or malformed text, a reversed part (``"2-1"``), a page below 1,
            or a selection with no page of the document.
        TooManyPages: more than ``max_pages`` pages selected.
    """
    if spec is not None and len(spec) > MAX_PAGE_RANGE_CHARS:
        raise PageRangeError(f"the page range is {len(spec):,} characters long; the limit is {MAX_PAGE_RANGE_CHARS:,}")
    intervals: list[tuple[int, int]] = []
    for part in spec.split(",") if spec is not None and spec.strip() else ["-"]:
        part = part.strip()
        match = _RANGE_PART.fullmatch(part)
        if match is None or not (match.group(1) or match.group(2)):
            raise PageRangeError(f"bad page range part {_quote(part)}: expected e.g. '1-3,5'")
        lo_s, dash, hi_s = match.groups()
        lo = int(lo_s) if lo_s else 1
        hi = (int(hi_s) if hi_s else page_count) if dash else lo
        if hi_s and lo > hi >= 1:
            raise PageRangeError(f"page range {_quote(part)} is reversed: write '{hi}-{lo}'")
        if lo < 1 or lo > hi:
            raise PageRangeError(f"page range {_quote(part)} is outside 1-{page_count}")
        if lo > page_count:
            _note(notes, f"page range {_quote(part)} is past the document's {page_count} page(s): dropped")
            continue
        if hi > page_count:
            _note(notes, f"page range {_quote(part)} clamped to the document's {page_count} page(s): {lo}-{page_count}")
            hi = page_count
        intervals.append((lo - 1, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):  # each page once, in order
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    if not merged:
        raise PageRangeError(f"page range {_quote(spec or '')} is outside 1-{page_count}")
    selected = sum(hi - lo for lo, hi in merged)
    if max_pages is not None and selected > max_pages:
        raise TooManyPages(f"{selected:,} pages selected; one parse takes at most {max_pages:,} (max_pages option)")
    return [index for lo, hi in merged for index in range(lo, hi)]


def _note(notes: list[str] | None, message: str) -> None:
    logger.warning("%s", message)
    if notes is not None:
        notes.append(message)


def _quote(text: str, limit: int = 24) -> str:
    """``repr`` of a user-supplied fragment, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _white_background(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(canvas, rgba).convert("RGB")


def _wide_gray_to_rgb(image: Image.Image) -> Image.Image:
    """16/32-bit integer or float grayscale -> 8-bit RGB, keeping tRNS transparency."""
    values = np.asarray(image)
    if image.mode == "F":
        scaled = values * 255.0 if values.size and float(values.max()) <= 1.0 else values
    else:
        wide = image.mode.startswith("I;16") or (values.size and int(values.max()) > 255)
        scaled = values / 257.0 if wide else values
    gray = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    transparent = image.info.get("transparency")
    if isinstance(transparent, int):
        gray = np.where(values == transparent, np.uint8(255), gray)
    return Image.fromarray(gray, mode="L").convert("RGB")


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF-orient and convert any Pillow mode to 8-bit RGB; transparency becomes white."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        return _wide_gray_to_rgb(image)
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        return _white_background(image)
    return image.convert("RGB")


def _limit_side(image: Image.Image, max_side: int) -> Image.Image:
    if max(image.size) <= max_side:
        return image
    scale = max_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


@dataclass
class OpenedDocument:
    """A readable document and its selected pages; render them one at a time.

    Attributes:
        name: a file stem (``"paper"``) or ``"document"`` for in-memory sources.
        format: ``"pdf"`` or the Pillow format name (``"PNG"``, ``"TIFF"``, ...).
        page_count: pages (frames) in the whole document.
        page_indices: 0-based indices of the selected pages, ascending.
        sha256: hex SHA-256 of the file's bytes; None for a PIL image source.
        warnings: what the page selection changed (a range clamped to the document, see
            ``parse_page_range``) and what is not read (the frames of an animation after its
            first); also logged.
    """

    name: str
    format: str
    page_count: int
    page_indices: list[int]
    sha256: str | None = None
    warnings: list[str] = field(default_factory=list)
    dpi: int = DEFAULT_DPI
    max_side: int = DEFAULT_MAX_SIDE
    max_pixels: int = DEFAULT_MAX_PIXELS
    render_timeout: float | None = None
    _pdf: object | None = field(default=None, repr=False)
    _source: tuple[bytes, str | None] | None = field(default=None, repr=False)  # a PDF's bytes and password
    _renderer: _PdfRenderer | None = field(default=None, repr=False)
    _image: Image.Image | None = field(default=None, repr=False)
    _owns_image: bool = field(default=True, repr=False)  # a caller's PIL image is never closed
    _render_timeouts: int = field(default=0, repr=False)  # pages that timed out rendering

    def render(self, index: int) -> Image.Image:
        """The RGB image of page ``index`` (0-based), long side at most ``max_side`` pixels.

        The page's size is read from its header (PDF page box, image frame header) and checked
        against ``max_pixels`` before anything is decoded.

        Raises:
            CorruptDocument: the page cannot be rendered or decoded.
            ImageTooLarge: the page has more than ``max_pixels`` pixels (or Pillow's own
                decompression-bomb limit refuses it).
        """
        if self._pdf is not None:
            return self._render_pdf_page(index)
        with self._decoding(index):
            self.page_size(index)  # checks the limit from the frame header
            frame = to_rgb(self._image)  # type: ignore[arg-type]
            return _limit_side(frame, self.max_side)

    def page_size(self, index: int) -> tuple[int, int]:
        """Width and height in pixels that page ``index`` decodes to, read from headers only.

        For an image, the frame's full resolution (before the ``max_side`` cap); for a PDF page,
        its render size at ``dpi`` with the long side capped at ``max_side``. Nothing is decoded,
        so this is cheap for any page.

        Raises:
            CorruptDocument: the page's header cannot be read.
            ImageTooLarge: the page has more than ``max_pixels`` pixels.
        """
        if self._pdf is not None:
            import pypdfium2 as pdfium

            with _PDFIUM_LOCK:
                try:
                    width_pt, height_pt = self._pdf.get_page_size(index)  # type: ignore[attr-defined]
                except pdfium.PdfiumError as exc:
                    raise CorruptDocument(f"{self.name}: cannot read page {index + 1}: {exc}") from exc
            size = self._pdf_render_size(width_pt, height_pt, index)
        else:
            with self._decoding(index):
                self._image.seek(index)  # type: ignore[union-attr]  # reads the frame header, decodes nothing
                size = self._image.size  # type: ignore[union-attr]
        self._check_pixels(size, index)
        return size

    def page_points(self, index: int) -> tuple[float, float]:
        """Width and height of page ``index`` in points, as MinerU 4 records them
        (``inputs.properties``: a PDF page's displayed box, an image at 200 dots per inch).

        Raises:
            CorruptDocument: the page's box or header cannot be read, or it has no area.
        """
        if self._pdf is not None:
            import pypdfium2 as pdfium

            with _PDFIUM_LOCK:
                try:
                    return pdf_page_points(self._pdf, index)
                except (pdfium.PdfiumError, ValueError) as exc:
                    raise CorruptDocument(f"{self.name}: cannot read the size of page {index + 1}: {exc}") from exc
        with self._decoding(index):
            self._image.seek(index)  # type: ignore[union-attr]  # a frame header, nothing decoded
            return image_page_points(self._image)  # type: ignore[arg-type]

    def properties(self) -> tuple[dict[str, Any], list[str]]:
        """What the document declares about itself (title, authors, dates, ...), as MinerU 4's
        ``metadata.document`` holds it before the page count (``inputs.properties.pdf_properties``);
        an image declares nothing.

        Returns:
            ``(properties, warnings)``: the fields that have a value, and what could not be read.
        """
        if self._pdf is None or self._source is None:
            return {}, []
        problems: list[str] = []
        with _PDFIUM_LOCK:
            try:
                info = self._pdf.get_metadata_dict()  # type: ignore[attr-defined]
            except Exception as exc:  # PDFium's errors are not typed
                info, problems = {}, [f"PDF Info: {exc}"]
        properties, warnings = pdf_properties(info, self._source[0])
        return properties, problems + warnings

    def page_cost(self, index: int) -> tuple[int, int]:
        """Memory that rendering page ``index`` takes, estimated from headers only (nothing decoded).

        Returns:
            ``(peak, kept)`` in bytes: the most ``render`` holds at once (the page's pixels at
            full resolution times its source's measured bytes per pixel, plus the downscaled copy
            when the long side is capped), and the rendered RGB page it returns.

        Raises:
            CorruptDocument / ImageTooLarge: as ``page_size``.
        """
        width, height = self.page_size(index)
        if self._pdf is not None:
            per_pixel = _PDF_BYTES_PER_PIXEL if self.render_timeout is None else _PDF_PROCESS_BYTES_PER_PIXEL
            return width * height * per_pixel, width * height * RGB_BYTES_PER_PIXEL
        image = self._image  # page_size left it on frame ``index``
        if image.mode in ("I", "F") or image.mode.startswith("I;16"):  # type: ignore[union-attr]
            per_pixel = _WIDE_BYTES_PER_PIXEL
        elif image.mode in _ALPHA_MODES or "transparency" in image.info:  # type: ignore[union-attr]
            per_pixel = _ALPHA_BYTES_PER_PIXEL
        else:
            per_pixel = _IMAGE_BYTES_PER_PIXEL
        scale = min(1.0, self.max_side / max(width, height))
        kept = max(1, round(width * scale)) * max(1, round(height * scale)) * RGB_BYTES_PER_PIXEL
        return width * height * per_pixel + (kept if scale < 1.0 else 0), kept

    def text_layer_mode(self, ocr_mode: str) -> tuple[str, str]:
        """Whether this document's text layer is used (``pdftext.resolve_ocr_mode``).

        Args:
            ocr_mode: ``"auto"``, ``"txt"`` or ``"ocr"``.

        Returns:
            ``(mode, reason)``: ``"txt"`` or ``"ocr"`` and the check that decided; images are
            always ``"ocr"``.

        Raises:
            ValueError: unknown ``ocr_mode``.
        """
        from mineru_fast.inputs.pdftext import resolve_ocr_mode

        if self._pdf is None:
            verdict = resolve_ocr_mode(ocr_mode, None)
        else:
            with _PDFIUM_LOCK:
                verdict = resolve_ocr_mode(ocr_mode, self._pdf)
        return verdict.mode, verdict.reason

    def page_text(self, index: int) -> PageText | None:
        """The text layer of page ``index`` (``pdftext.read_page_text``); None for images.

        Raises:
            CorruptDocument: PDFium cannot read the page.
        """
        import pypdfium2 as pdfium

        from mineru_fast.inputs.pdftext import read_page_text

        if self._pdf is None:
            return None
        with _PDFIUM_LOCK:
            try:
                page = self._pdf[index]  # type: ignore[index]
                try:
                    return read_page_text(page)
                finally:
                    page.close()
            except pdfium.PdfiumError as exc:
                raise CorruptDocument(f"{self.name}: cannot read the text of page {index + 1}: {exc}") from exc

    def _pdf_render_size(self, width_pt: float, height_pt: float, index: int) -> tuple[int, int]:
        if not (math.isfinite(width_pt) and math.isfinite(height_pt) and width_pt > 0 and height_pt > 0):
            raise CorruptDocument(f"{self.name}: page {index + 1} has no usable size ({width_pt} x {height_pt} pt)")
        scale = min(self.dpi / 72.0, self.max_side / max(width_pt, height_pt))
        return max(1, math.ceil(width_pt * scale)), max(1, math.ceil(height_pt * scale))

    def _check_pixels(self, size: tuple[int, int], index: int) -> None:
        if size[0] * size[1] > self.max_pixels:
            what = f"page {index + 1}" if self._pdf is not None else f"frame {index + 1}"
            raise ImageTooLarge(
                f"{self.name}: {what} is {size[0]}x{size[1]} pixels, over the limit of {self.max_pixels:,} "
                "(max_image_pixels option)"
            )

    @contextlib.contextmanager
    def _decoding(self, index: int) -> Iterator[None]:
        """Map whatever Pillow raises on a damaged frame to this package's errors."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies
                yield
        except InputError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageTooLarge(f"{self.name}: frame {index + 1}: {exc}") from exc
        except MemoryError as exc:
            raise ImageTooLarge(f"{self.name}: frame {index + 1} does not fit in memory") from exc
        except Exception as exc:  # Pillow's decoders raise many types on malformed data
            raise CorruptDocument(f"{self.name}: cannot decode image frame {index + 1}: {_describe(exc)}") from exc

    def _render_pdf_page(self, index: int) -> Image.Image:
        import pypdfium2 as pdfium

        if self._render_timeouts >= MAX_RENDER_TIMEOUTS:
            raise RenderTimeout(
                f"{self.name}: page {index + 1} not rendered: {self._render_timeouts} pages of this document "
                f"took longer than {self.render_timeout:g} s to render already (render_timeout option)"
            )

        with _PDFIUM_LOCK:
            try:
                page = self._pdf[index]  # type: ignore[index]
                width_pt, height_pt = page.get_size()  # displayed size, /Rotate applied
                self._check_pixels(self._pdf_render_size(width_pt, height_pt, index), index)
                scale = min(self.dpi / 72.0, self.max_side / max(width_pt, height_pt))
                if self.render_timeout is None:
                    image = page.render(scale=scale, may_draw_forms=True).to_pil()
            except pdfium.PdfiumError as exc:
                raise CorruptDocument(f"{self.name}: cannot render page {index + 1}: {exc}") from exc
        if self.render_timeout is not None:  # out of process, outside the lock
            if self._renderer is None:
                self._renderer = _PdfRenderer(*self._source)  # type: ignore[misc]
            try:
                return self._renderer.render(index, scale, self.render_timeout)
            except RenderTimeout:
                self._renderer = None  # killed: the next page gets a fresh process
                self._render_timeouts += 1
                raise RenderTimeout(
                    f"{self.name}: page {index + 1} took longer than {self.render_timeout:g} s to render "
                    "(render_timeout option)"
                ) from None
            except CorruptDocument as exc:
                if not self._renderer.alive:  # it died on this page: the next page gets a fresh process
                    self._renderer = None
                raise CorruptDocument(f"{self.name}: cannot render page {index + 1}: {exc}") from None
        return image.convert("RGB")

    def close(self) -> None:
        """Release the underlying PDF or image handle and the render process (idempotent)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        if self._pdf is not None:
            with _PDFIUM_LOCK:
                self._pdf.close()  # type: ignore[attr-defined]
            self._pdf = None
        if self._image is not None:
            if self._owns_image:
                self._image.close()
            self._image = None

    def __enter__(self) -> OpenedDocument:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _render_worker(conn: Connection, data: bytes, password: str | None) -> None:
    """The render process: opens the PDF once, then renders ``(index, scale)`` requests until
    the pipe closes, answering ``("ok", (width, height), rgb_bytes)`` or ``("error", message)``.
    It ends quietly when the parent is gone (a pipe closed under it) and ignores Ctrl-C meant for
    the server: either printed a traceback into the server's JSON log at shutdown. The parent ends
    this process when it closes the renderer; should the parent end otherwise (``kill -9``), this
    process ends at once, even inside a render (``_end_with_parent``)."""
    import signal

    import pypdfium2 as pdfium

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with_parent, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        _render_requests(conn, pdfium, data, password)
    except (EOFError, OSError):  # the parent closed the pipe or ended
        return


def _end_with_parent(parent: multiprocessing.process.BaseProcess) -> None:
    """End this process as soon as ``parent`` (the process that started it) has ended.

    The pipe to the parent is only read between pages, and PDFium cannot be interrupted: killed
    with -9, ``serve`` left its render process rendering at full CPU until the page was done, and
    the forkserver up with it (a forkserver lives while any process it started does). The parent
    is the process that asked for this one, not the forkserver that forked it: multiprocessing's
    parent sentinel ends (EOF) when that process does, however it ends."""
    parent.join()
    os._exit(1)


def _render_requests(conn: Connection, pdfium, data: bytes, password: str | None) -> None:  # noqa: ANN001
    try:
        pdf = pdfium.PdfDocument(data, password=password)
    except pdfium.PdfiumError as exc:
        conn.send(("error", str(exc)))
        return
    while True:
        index, scale = conn.recv()
        try:
            image = pdf[index].render(scale=scale, may_draw_forms=True).to_pil().convert("RGB")
        except pdfium.PdfiumError as exc:
            conn.send(("error", str(exc)))
            continue
        conn.send(("ok", image.size, image.tobytes()))


class _PdfRenderer:
    """Renders a PDF's pages in a child process (multiprocessing's ``forkserver``, or ``spawn``
    where there is none), so a page that PDFium needs too long for can be stopped: PDFium cannot
    be interrupted, and in this process it holds the process-wide lock while it renders.

    Args:
        data: the PDF's bytes (sent to the process once).
        password: its user password, if any.
    """

    def __init__(self, data: bytes, password: str | None) -> None:
        context: BaseContext
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__, "pypdfium2"])  # a render process starts warm
        else:
            context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_render_worker, args=(child, data, password), daemon=True)
        try:
            self._process.start()
        except (OSError, RuntimeError, ValueError) as exc:  # no process to be had (limits, a daemon parent)
            self._conn.close()
            raise CorruptDocument(f"cannot start a render process: {exc}") from exc
        finally:
            child.close()

    @property
    def alive(self) -> bool:
        """Whether the process can render another page."""
        return not self._conn.closed and self._process.is_alive()

    def render(self, index: int, scale: float, timeout: float) -> Image.Image:
        """Page ``index`` at ``scale`` as RGB, or the process is killed after ``timeout`` seconds.

        Raises:
            RenderTimeout: no answer within ``timeout`` (the process is killed; use a new renderer).
            CorruptDocument: PDFium failed, or the process died (``alive`` then False).
        """
        try:
            self._conn.send((index, scale))
            answered = self._conn.poll(timeout)
            reply = self._conn.recv() if answered else None
        except (EOFError, OSError) as exc:
            self.close()
            raise CorruptDocument(f"the render process ended ({exc or type(exc).__name__})") from None
        if reply is None:
            self.close()
            raise RenderTimeout(f"no page after {timeout:g} s")
        if reply[0] == "error":
            raise CorruptDocument(reply[1])
        _, size, pixels = reply
        return Image.frombytes("RGB", size, pixels)

    def close(self) -> None:
        """Stop the process (killed: it may be inside a render that never ends)."""
        self._conn.close()
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=10)


def _read_source(source: str | Path | bytes | bytearray) -> tuple[str, bytes]:
    if isinstance(source, (bytes, bytearray)):
        return "document", bytes(source)
    path = Path(source)
    return path.stem or "document", read_path(path)


def read_path(path: Path) -> bytes:
    """A document file's bytes (``DocumentParser`` and ``mineru_fast.client`` read files so).

    Raises:
        DocumentNotFound: no such file. InputError: a directory, or the file cannot be read.
    """
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DocumentNotFound(f"no such file: {path}") from None
    except IsADirectoryError:
        raise InputError(f"is a directory, not a document: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _open_pdf(
    name: str, data: bytes, password: str | None, pages: str | None, limits: PageLimits, max_pages: int
) -> OpenedDocument:
    import pypdfium2 as pdfium

    with _PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(data, password=password)
            page_count = len(pdf)
        except pdfium.PdfiumError as exc:
            code = _load_error(data, password)
            if code is None:  # it loads: pypdfium2 refused it for having no pages
                raise CorruptDocument(f"{name}: the PDF has no pages") from exc
            if code == _PDFIUM_PASSWORD_ERROR:
                hint = "the password is wrong" if password else "it is encrypted"
                raise PasswordRequired(
                    f"{name}: {hint}; pass the password with --password (CLI), password= (Python)"
                    " or the password form field (HTTP)"
                ) from exc
            raise CorruptDocument(f"{name}: not a readable PDF ({exc})") from exc
    if page_count == 0:
        pdf.close()
        raise CorruptDocument(f"{name}: the PDF has no pages")
    notes: list[str] = []
    try:
        indices = parse_page_range(pages, page_count, max_pages=max_pages, notes=notes)
    except InputError:
        pdf.close()
        raise
    return OpenedDocument(name, "pdf", page_count, indices, warnings=notes, _pdf=pdf, **limits)


def _load_error(data: bytes, password: str | None) -> int | None:
    """PDFium's error code for loading ``data`` (``FPDF_ERR_*``), or None when it loads. The
    caller holds the PDFium lock.

    The code is read right after a load that failed, which sets it: PDFium keeps one last error
    per process and a load that succeeds leaves it as it was, so the code pypdfium2 attaches when
    it refuses a PDF of no pages (which loads) is whatever an earlier document left, e.g. the
    wrong password of the previous request."""
    import pypdfium2.raw as pdfium_c

    secret = None if password is None else (password + "\0").encode("utf-8")
    handle = pdfium_c.FPDF_LoadMemDocument64(data, len(data), secret)
    if handle:
        pdfium_c.FPDF_CloseDocument(handle)
        return None
    return pdfium_c.FPDF_GetLastError()


def _open_image(
    name: str, image: Image.Image, pages: str | None, limits: PageLimits, max_pages: int, owned: bool = True
) -> OpenedDocument:
    notes: list[str] = []
    try:
        frames = _count_frames(name, image) if image.format in _MULTI_FRAME_FORMATS else 1
        if image.format not in _MULTI_FRAME_FORMATS and getattr(image, "is_animated", False):  # from headers
            dropped = "the other frames are dropped (save them as a multi-page TIFF or PDF to read each as a page)"
            _note(notes, f"{name}: an animated {image.format}: only its first frame is read; {dropped}")
    except InputError:
        raise
    except Exception as exc:  # a damaged frame chain
        raise CorruptDocument(f"{name}: cannot read the image's frames: {_describe(exc)}") from exc
    opened = OpenedDocument(
        name, image.format or "image", frames, [], warnings=notes, _image=image, _owns_image=owned, **limits
    )
    try:
        opened.page_indices = parse_page_range(pages, frames, max_pages=max_pages, notes=opened.warnings)
        opened._check_pixels(image.size, 0)
    except InputError:
        opened.close()
        raise
    return opened


def _count_frames(name: str, image: Image.Image) -> int:
    """Frames of a multi-frame image, reading at most ``MAX_IMAGE_FRAMES + 1`` frame headers.

    Raises:
        ImageTooLarge: more than ``MAX_IMAGE_FRAMES`` frames (a small TIFF can chain millions of
            tiny frames, and reading each header takes Pillow tens of microseconds).
    """
    frames = 0
    try:
        for index in range(MAX_IMAGE_FRAMES + 1):  # one header at a time, nothing decoded
            image.seek(index)
            frames = index + 1
    except EOFError:
        pass
    finally:
        image.seek(0)
    if frames > MAX_IMAGE_FRAMES:
        raise ImageTooLarge(f"{name}: the image has more than {MAX_IMAGE_FRAMES:,} frames")
    return frames


def _describe(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


# The formats MinerU 4 reads natively (mineru 4.0.12 mineru/filetypes.py: office, ODF, EPUB, OFD,
# HTML, CSV): ZIP members that name them, then leading bytes, then the file suffix.
_ZIP_KINDS = (("word/", "DOCX"), ("ppt/", "PPTX"), ("xl/", "XLSX"), ("Doc_0/", "OFD"))
_ODF_KINDS = {
    b"application/epub+zip": "EPUB",
    b"application/vnd.oasis.opendocument.text": "ODT",
    b"application/vnd.oasis.opendocument.spreadsheet": "ODS",
    b"application/vnd.oasis.opendocument.presentation": "ODP",
}
_SUFFIX_KINDS = {".csv": "CSV", ".tsv": "TSV", ".mhtml": "MHTML", ".mht": "MHTML", ".doc": "DOC", ".xls": "XLS",
                 ".ppt": "PPT", ".htm": "HTML", ".html": "HTML", ".epub": "EPUB", ".ofd": "OFD"}  # fmt: skip


def native_kind(name: str, data: bytes) -> str | None:
    """The kind of document MinerU 4 parses natively that ``data`` holds (``"DOCX"``, ``"EPUB"``,
    ``"HTML"``, ...), or None. Read from ZIP members, leading bytes, then the suffix of ``name``."""
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                names = archive.namelist()
                if "mimetype" in names and (kind := _ODF_KINDS.get(archive.read("mimetype").strip())):
                    return kind
        except (zipfile.BadZipFile, OSError, KeyError):
            names = []
        for prefix, kind in _ZIP_KINDS:
            if any(member.startswith(prefix) for member in names):
                return kind
    head = data[:1024].lstrip().lower()
    if data[:8] == b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1":  # OLE2: DOC, XLS, PPT
        return _SUFFIX_KINDS.get(Path(name).suffix.lower(), "Office (OLE2)")
    if head.startswith(b"{\\rtf"):
        return "RTF"
    if head.startswith((b"<!doctype html", b"<html")) or b"<html" in head:
        return "HTML"
    return _SUFFIX_KINDS.get(Path(name).suffix.lower())


def open_document(
    source: Source,
    *,
    password: str | None = None,
    pages: str | None = None,
    dpi: int = DEFAULT_DPI,
    max_side: int = DEFAULT_MAX_SIDE,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_pages: int = DEFAULT_MAX_PAGES,
    decode_first: bool = True,
    render_timeout: float | None = None,
) -> OpenedDocument:
    """Open a PDF or image from a path, bytes or a PIL image.

    Args:
        source: file path, raw bytes, or a ``PIL.Image.Image`` (one page).
        password: user password of an encrypted PDF.
        pages: 1-based page range such as ``"1-3,5"``; None selects every page. A range past the
            document is clamped to it, with a warning (``OpenedDocument.warnings``).
        dpi: PDF render resolution in dots per inch.
        max_side: longest side of a page image in pixels (PDF scale and images are capped).
        max_pixels: refuse images, image frames or PDF pages (at render size) with more pixels
            than this; each is checked from its header before it is decoded.
        max_pages: refuse a selection of more pages than this, before any page is read.
        decode_first: decode an image's first frame now, so that a truncated file fails here;
            False reads headers only (then nothing is decoded before ``render``).
        render_timeout: seconds a PDF page may take to render; None renders in this process
            with no bound (PDFium holds a process-wide lock meanwhile). With a bound, a PDF's
            pages are rendered in a child process, killed when a page takes longer: that page
            fails alone (``RenderTimeout``); once ``MAX_RENDER_TIMEOUTS`` pages of the document
            have, its other pages fail at once with ``RenderTimeout``, unrendered.

    Returns:
        An ``OpenedDocument``; close it (or use it as a context manager) when done.

    Raises:
        DocumentNotFound: no such file. InputError: unreadable path. UnsupportedFormat: neither
            PDF nor image (``NativeDocument`` for a format MinerU 4 reads natively, naming the tool).
        CorruptDocument: empty or damaged. PasswordRequired: encrypted PDF without the right password.
        ImageTooLarge: the first frame is over ``max_pixels`` (later frames fail at ``render``).
        PageRangeError: bad ``pages``. TooManyPages: more than ``max_pages`` pages selected.
    """
    limits = PageLimits(dpi=dpi, max_side=max_side, max_pixels=max_pixels, render_timeout=render_timeout)
    if isinstance(source, Image.Image):
        return _open_image("document", source, pages, limits, max_pages, owned=False)
    name, data = _read_source(source)
    if not data:
        raise CorruptDocument(f"{name}: the file is empty (0 bytes)")
    if b"%PDF-" in data[:1024]:
        opened = _open_pdf(name, data, password, pages, limits, max_pages)
        opened.sha256 = hashlib.sha256(data).hexdigest()
        opened._source = (data, password)  # for a render process
        return opened
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"{name}: {exc}") from exc
    except UnidentifiedImageError:
        file_name = Path(source).name if isinstance(source, (str, Path)) else name
        if kind := native_kind(file_name, data):
            raise NativeDocument(
                f"{name}: a {kind} document, which MinerU 4 parses natively (tier flash, no model): "
                f"`mineru-kit parse {file_name} -o OUT --tier flash`, or DocVortex, MinerU 4's parser of such files "
                "(`pip install 'mineru-fast[mineru4]'`, then `docvortex`); mineru-fast reads PDFs and images"
            ) from None
        raise UnsupportedFormat(f"{name}: not a PDF or a supported image format") from None
    except Exception as exc:  # Pillow's format plugins raise many types on malformed headers
        raise CorruptDocument(f"{name}: cannot decode image: {_describe(exc)}") from exc
    with _closing_on_error(image):
        opened = _open_image(name, image, pages, limits, max_pages)
    opened.sha256 = hashlib.sha256(data).hexdigest()
    if decode_first:
        with _closing_on_error(opened), opened._decoding(0):
            image.load()  # decode the first frame now: a truncated file fails here, typed
    return opened


@contextlib.contextmanager
def _closing_on_error(resource: Image.Image | OpenedDocument) -> Iterator[None]:
    try:
        yield
    except BaseException:
        resource.close()
        raise
