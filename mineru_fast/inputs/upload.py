"""What the HTTP client sends: a document's bytes, with very large images made smaller first.

The service renders an image page the way ``mineru_fast.inputs.documents`` does: EXIF orientation applied,
converted to RGB, long side capped at ``DEFAULT_MAX_SIDE`` (3500 px). An image above that cap (or
above a byte size) is rendered here by that same code and re-encoded before upload: as PNG, which
is lossless, so the service sees exactly the page it would have made from the original; a JPEG
source stays JPEG (it was lossy already) at ``jpeg_quality``. The smaller of the original and the
re-encoded file is sent. PDFs and multi-frame images (one page per frame) are always sent as they are.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from mineru_fast.errors import InputError
from mineru_fast.inputs.documents import DEFAULT_MAX_SIDE, IMAGE_FORMATS, open_document, read_path

__all__ = ["UploadPolicy", "Upload", "prepare_upload"]

UploadSource = str | Path | bytes | bytearray | BinaryIO | Image.Image


@dataclass(frozen=True)
class UploadPolicy:
    """When the client re-encodes an image before upload.

    Attributes:
        max_side: an image whose long side exceeds this many pixels is downscaled to it; default
            the service's own cap (``inputs.DEFAULT_MAX_SIDE``), so nothing the service would keep
            is lost. None: never downscale.
        max_bytes: an image file larger than this is re-encoded even when not downscaled (an
            uncompressed BMP or TIFF shrinks losslessly); None: never for size alone.
        jpeg_quality: quality of a re-encoded JPEG source (Pillow's 1-95 scale).
    """

    max_side: int | None = DEFAULT_MAX_SIDE
    max_bytes: int | None = 8 * 1024 * 1024
    jpeg_quality: int = 95

    def __post_init__(self) -> None:
        if self.max_side is not None and self.max_side < 28:
            raise ValueError(f"max_side must be >= 28 pixels (one vision patch pair), got {self.max_side}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if not 1 <= self.jpeg_quality <= 95:
            raise ValueError(f"jpeg_quality must be in 1..95, got {self.jpeg_quality}")


@dataclass(frozen=True)
class Upload:
    """A document ready to send.

    Attributes:
        name: file name sent with the multipart field (the service never uses it for paths).
        data: the bytes sent.
        original_bytes: size of the document as given.
        reencoded: whether ``data`` is a re-encoded image rather than the original bytes.
    """

    name: str
    data: bytes
    original_bytes: int
    reencoded: bool = False


def _read(source: UploadSource) -> tuple[str, bytes]:
    """(file name, bytes) of any accepted source; a PIL image is encoded as PNG (lossless)."""
    if isinstance(source, Image.Image):
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        return "document.png", buffer.getvalue()
    if isinstance(source, (bytes, bytearray)):
        return "document", bytes(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        return path.name, read_path(path)
    return Path(getattr(source, "name", "document")).name or "document", source.read()


def _needs_shrinking(data: bytes, policy: UploadPolicy) -> str | None:
    """The image's Pillow format when it should be re-encoded; None for PDFs, multi-frame or
    undecodable files (the service judges those) and images within the policy."""
    if b"%PDF-" in data[:1024]:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:  # reads the header only
                size, frames, fmt = probe.size, getattr(probe, "n_frames", 1), probe.format
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None
    too_wide = policy.max_side is not None and max(size) > policy.max_side
    too_big = policy.max_bytes is not None and len(data) > policy.max_bytes
    return fmt if frames == 1 and (too_wide or too_big) else None


def prepare_upload(source: UploadSource, policy: UploadPolicy | None = None) -> Upload:
    """Read ``source`` and shrink it when it is a single image over the policy's limits.

    Args:
        source: file path, bytes, a binary file object, or a PIL image.
        policy: when to re-encode; default ``UploadPolicy()``.

    Returns:
        The ``Upload``; ``data`` is the original bytes unless re-encoding made them smaller.

    Raises:
        InputError: the path cannot be read.
    """
    policy = policy or UploadPolicy()
    name, data = _read(source)
    fmt = _needs_shrinking(data, policy)
    if fmt is None:
        return Upload(name, data, len(data))
    try:
        with open_document(data, max_side=policy.max_side or 1 << 30, max_pixels=1 << 62) as opened:
            page = opened.render(0)  # the service's own rendering: orientation, RGB, side cap
    except InputError:  # undecodable after all: the service will say what is wrong
        return Upload(name, data, len(data))
    buffer = io.BytesIO()
    if fmt in ("JPEG", "MPO"):
        page.save(buffer, format="JPEG", quality=policy.jpeg_quality)
        suffix = ".jpg"
    else:
        page.save(buffer, format="PNG")
        suffix = ".png"
    if buffer.tell() >= len(data):
        return Upload(name, data, len(data))
    return Upload(str(Path(name).with_suffix(suffix)), buffer.getvalue(), len(data), reencoded=True)
