"""The one exception hierarchy of mineru-fast.

``MineruFastError`` is the root. Input problems (``InputError`` and its subclasses) concern one
document and make the CLI exit with status 2; ``ModelLoadError`` concerns the model. Errors chain
the underlying library exception with ``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "MineruFastError",
    "InputError",
    "UnsupportedFormat",
    "CorruptDocument",
    "PasswordRequired",
    "ImageTooLarge",
    "PageRangeError",
    "ModelLoadError",
    "LayoutModelMissing",
    "TraceError",
    "BenchmarkError",
]


class MineruFastError(Exception):
    """Base class of every error raised by mineru-fast."""


class InputError(MineruFastError):
    """A document cannot be read (one document fails, never the whole batch)."""


class UnsupportedFormat(InputError):
    """The bytes are neither a PDF nor an image format Pillow can read."""


class CorruptDocument(InputError):
    """The file looks like a supported format but cannot be decoded (empty, truncated, damaged)."""


class PasswordRequired(InputError):
    """The PDF is encrypted and no password, or a wrong one, was given."""


class ImageTooLarge(InputError):
    """An image or rendered page exceeds the configured pixel limit (decompression-bomb guard)."""


class PageRangeError(InputError):
    """A page range such as ``"1-3,5"`` is malformed or outside the document."""


class ModelLoadError(MineruFastError):
    """A model directory or hub id cannot be resolved or loaded."""


class LayoutModelMissing(ModelLoadError):
    """The layout detector's weights (PP-DocLayoutV2, for ``tier="standard"``) are not on this
    machine and cannot be downloaded; the message says what to download and where it was looked
    for."""


class TraceError(MineruFastError):
    """A replay trace file is malformed or does not fit the document it is applied to."""


class BenchmarkError(MineruFastError):
    """A benchmark run was asked for something it cannot do (more pages than the workload has,
    a row filter that matches no row)."""
