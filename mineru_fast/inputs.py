"""Documents in, RGB page images out.

PDFs are rendered with pypdfium2 (200 DPI, long side capped, page ``/Rotate`` honoured, so boxes
refer to the page as displayed); images are decoded with Pillow (EXIF orientation applied; CMYK,
16-bit, palette and alpha converted to RGB on white; each frame of a multi-frame TIFF is a page).
The format is detected from the content, never from the file name. Pages are produced lazily, one
at a time, so a long PDF never sits in memory as images.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import CorruptDocument, ImageTooLarge, InputError, PageRangeError, PasswordRequired, UnsupportedFormat

logger = logging.getLogger(__name__)

Source = str | Path | bytes | bytearray | Image.Image

DEFAULT_DPI = 200
DEFAULT_MAX_SIDE = 3500
DEFAULT_MAX_PIXELS = 150_000_000  # Pillow refuses images above 2 * 89,478,485 pixels regardless.
_PDFIUM_PASSWORD_ERROR = 4  # FPDF_ERR_PASSWORD
_PDFIUM_LOCK = threading.Lock()  # PDFium is not thread-safe
_MULTI_FRAME_FORMATS = {"TIFF", "MPO"}


def parse_page_range(spec: str | None, page_count: int) -> list[int]:
    """Turn ``"1-3,5"`` (1-based, inclusive; ``"7-"`` means to the end) into sorted 0-based indices.

    Raises:
        PageRangeError: malformed text, a page outside ``1..page_count``, or an empty selection.
    """
    if spec is None or not spec.strip():
        return list(range(page_count))
    selected: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo = int(lo_s) if lo_s.strip() else 1
                hi = int(hi_s) if hi_s.strip() else page_count
            else:
                lo = hi = int(part)
        except ValueError:
            raise PageRangeError(f"bad page range {spec!r}: expected e.g. '1-3,5'") from None
        if lo < 1 or hi > page_count or lo > hi:
            raise PageRangeError(f"page range {part!r} is outside 1-{page_count}")
        selected.update(range(lo - 1, hi))
    return sorted(selected)


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
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
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
    """

    name: str
    format: str
    page_count: int
    page_indices: list[int]
    dpi: int = DEFAULT_DPI
    max_side: int = DEFAULT_MAX_SIDE
    max_pixels: int = DEFAULT_MAX_PIXELS
    _pdf: object | None = field(default=None, repr=False)
    _image: Image.Image | None = field(default=None, repr=False)
    _owns_image: bool = field(default=True, repr=False)  # a caller's PIL image is never closed

    def render(self, index: int) -> Image.Image:
        """The RGB image of page ``index`` (0-based), long side at most ``max_side`` pixels.

        Raises:
            CorruptDocument: the page cannot be rendered or decoded.
            ImageTooLarge: the page has more than ``max_pixels`` pixels.
        """
        if self._pdf is not None:
            return self._render_pdf_page(index)
        assert self._image is not None
        try:
            if index:
                self._image.seek(index)
            frame = to_rgb(self._image)
        except (OSError, ValueError, EOFError) as exc:
            raise CorruptDocument(f"{self.name}: cannot decode image frame {index + 1}: {exc}") from exc
        return _limit_side(frame, self.max_side)

    def _render_pdf_page(self, index: int) -> Image.Image:
        import pypdfium2 as pdfium

        with _PDFIUM_LOCK:
            try:
                page = self._pdf[index]  # type: ignore[index]
                width_pt, height_pt = page.get_size()  # displayed size, /Rotate applied
                scale = min(self.dpi / 72.0, self.max_side / max(width_pt, height_pt, 1e-6))
                pixels = width_pt * height_pt * scale * scale
                if pixels > self.max_pixels:
                    raise ImageTooLarge(f"{self.name}: page {index + 1} would render to {pixels:,.0f} pixels")
                image = page.render(scale=scale, may_draw_forms=True).to_pil()
            except pdfium.PdfiumError as exc:
                raise CorruptDocument(f"{self.name}: cannot render page {index + 1}: {exc}") from exc
        return image.convert("RGB")

    def close(self) -> None:
        """Release the underlying PDF or image handle (idempotent)."""
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


def _read_source(source: Source) -> tuple[str, bytes]:
    if isinstance(source, (bytes, bytearray)):
        return "document", bytes(source)
    path = Path(source)
    try:
        return path.stem or "document", path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise InputError(f"is a directory, not a document: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _open_pdf(name: str, data: bytes, password: str | None, pages: str | None, **limits: int) -> OpenedDocument:
    import pypdfium2 as pdfium

    with _PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(data, password=password)
            page_count = len(pdf)
        except pdfium.PdfiumError as exc:
            if getattr(exc, "err_code", None) == _PDFIUM_PASSWORD_ERROR:
                hint = "the password is wrong" if password else "it is encrypted"
                raise PasswordRequired(
                    f"{name}: {hint}; pass the password with --password (CLI) or password= (Python)"
                ) from exc
            raise CorruptDocument(f"{name}: not a readable PDF ({exc})") from exc
    if page_count == 0:
        pdf.close()
        raise CorruptDocument(f"{name}: the PDF has no pages")
    try:
        indices = parse_page_range(pages, page_count)
    except PageRangeError:
        pdf.close()
        raise
    return OpenedDocument(name, "pdf", page_count, indices, _pdf=pdf, **limits)


def _open_image(name: str, image: Image.Image, pages: str | None, owned: bool = True, **limits: int) -> OpenedDocument:
    max_pixels = limits["max_pixels"]
    if image.width * image.height > max_pixels:
        if owned:
            image.close()
        raise ImageTooLarge(
            f"{name}: {image.width}x{image.height} pixels exceeds the limit of {max_pixels:,} (max_image_pixels option)"
        )
    frames = getattr(image, "n_frames", 1) if image.format in _MULTI_FRAME_FORMATS else 1
    indices = parse_page_range(pages, frames)
    return OpenedDocument(name, image.format or "image", frames, indices, _image=image, _owns_image=owned, **limits)


def open_document(
    source: Source,
    *,
    password: str | None = None,
    pages: str | None = None,
    dpi: int = DEFAULT_DPI,
    max_side: int = DEFAULT_MAX_SIDE,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> OpenedDocument:
    """Open a PDF or image from a path, bytes or a PIL image.

    Args:
        source: file path, raw bytes, or a ``PIL.Image.Image`` (one page).
        password: user password of an encrypted PDF.
        pages: 1-based page range such as ``"1-3,5"``; None selects every page.
        dpi: PDF render resolution in dots per inch.
        max_side: longest side of a page image in pixels (PDF scale and images are capped).
        max_pixels: refuse images (or PDF pages at render size) with more pixels than this.

    Returns:
        An ``OpenedDocument``; close it (or use it as a context manager) when done.

    Raises:
        InputError: unreadable path. UnsupportedFormat: neither PDF nor image. CorruptDocument:
        empty or damaged. PasswordRequired: encrypted PDF without the right password.
        ImageTooLarge: over ``max_pixels``. PageRangeError: bad ``pages``.
    """
    limits = {"dpi": dpi, "max_side": max_side, "max_pixels": max_pixels}
    if isinstance(source, Image.Image):
        return _open_image("document", source, pages, owned=False, **limits)
    name, data = _read_source(source)
    if not data:
        raise CorruptDocument(f"{name}: the file is empty (0 bytes)")
    if b"%PDF-" in data[:1024]:
        return _open_pdf(name, data, password, pages, **limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        if image.width * image.height <= max_pixels:
            image.load()  # decode the first frame now: a truncated file fails here, typed
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"{name}: {exc}") from exc
    except UnidentifiedImageError:
        raise UnsupportedFormat(f"{name}: not a PDF or a supported image format") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise CorruptDocument(f"{name}: cannot decode image: {exc}") from exc
    return _open_image(name, image, pages, **limits)
