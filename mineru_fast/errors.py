"""The one exception hierarchy of mineru-fast.

``MineruFastError`` is the root. Input problems (``InputError`` and its subclasses) concern one
document and make the CLI exit with status 2; ``ModelLoadError`` concerns the model;
``ServiceError`` and its subclasses are what ``mineru_fast.client`` raises for the HTTP service's
answers. Errors chain the underlying library exception with ``raise ... from``.
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
    "SourceError",
    "ModelLoadError",
    "ModelNotCached",
    "LayoutModelMissing",
    "TraceError",
    "BenchmarkError",
    "ServiceError",
    "ServiceUnreachable",
    "AuthenticationFailed",
    "DocumentRejected",
    "JobNotFound",
    "JobFailed",
    "RateLimited",
    "ServiceUnavailable",
    "INPUT_ERROR_CODES",
    "error_code",
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


class SourceError(InputError):
    """An input location cannot be listed or read: a URI scheme pyarrow has no filesystem for, a
    path that does not exist, a store that cannot be reached (``mineru-fast batch`` inputs)."""


class ModelLoadError(MineruFastError):
    """A model directory or hub id cannot be resolved or loaded."""


class ModelNotCached(ModelLoadError):
    """Offline (``HF_HUB_OFFLINE=1``, ``--offline``, ``local_files_only=True``) and the model, the
    revision asked for, or some of its files are not in the local Hugging Face cache; the message
    names what is missing and the cache folder that was searched."""


class LayoutModelMissing(ModelLoadError):
    """The layout detector's weights (PP-DocLayoutV2, for ``tier="standard"``) are not on this
    machine and cannot be downloaded; the message says what to download and where it was looked
    for."""


class TraceError(MineruFastError):
    """A replay trace file is malformed or does not fit the document it is applied to."""


class BenchmarkError(MineruFastError):
    """A benchmark run was asked for something it cannot do (more pages than the workload has,
    a row filter that matches no row)."""


# Stable codes of input and trace errors (results' ``ParseError.code``, the service's error codes);
# most specific first: the first matching class wins.
INPUT_ERROR_CODES: tuple[tuple[type[MineruFastError], str], ...] = (
    (UnsupportedFormat, "unsupported_format"),
    (CorruptDocument, "corrupt_document"),
    (PasswordRequired, "password_required"),
    (ImageTooLarge, "image_too_large"),
    (PageRangeError, "bad_page_range"),
    (InputError, "invalid_document"),
    (TraceError, "bad_replay_trace"),
)


def error_code(exc: BaseException, default: str = "internal_error") -> str:
    """The stable code of an input or trace error (``INPUT_ERROR_CODES``); ``default`` for any other."""
    for cls, code in INPUT_ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return default


class ServiceError(MineruFastError):
    """The HTTP service answered with an error, or could not be reached (``mineru_fast.client``).

    The service's error body is ``{"error": {"code", "message", "request_id"}}``; its fields are
    kept here.

    Attributes:
        message: the service's message (or what went wrong on the way).
        status: HTTP status; None when no answer came.
        code: the service's stable error code (``"queue_full"``, ``"corrupt_document"``, ...);
            ``"unreachable"`` without an answer, ``"http_<status>"`` for a body not in that form.
        request_id: the service's request id (its ``X-Request-ID``), for its logs.
        retry_after: seconds the service asked to wait (``Retry-After``), if it said.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "",
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}" if status else message)
        self.message, self.status, self.code = message, status, code
        self.request_id, self.retry_after = request_id, retry_after


class ServiceUnreachable(ServiceError):
    """No answer: connection refused or broken, or a timeout, after every retry."""


class AuthenticationFailed(ServiceError):
    """``401``: the API key is missing or not valid."""


class DocumentRejected(ServiceError, InputError):
    """``413`` / ``422``: the service refused the document or its fields (format, corruption,
    password, page range, size); ``code`` says which. Also an ``InputError``, as a local parse's."""


class JobNotFound(ServiceError):
    """``404``: unknown job id, another key's job, or its result expired (or the server restarted)."""


class JobFailed(ServiceError):
    """A job ended ``failed`` or ``cancelled``; ``code`` and ``message`` are the job's error."""


class RateLimited(ServiceError):
    """``429`` after every retry: the queue is full or the key is over its rate (``retry_after``)."""


class ServiceUnavailable(ServiceError):
    """``503`` after every retry: the model is loading or failed to load, or the server is shutting
    down; or a ``5xx`` that a proxy in front of the service answered instead of it (no JSON error
    body, e.g. Ray Serve's ``500`` when the replica handling the request died), after every retry."""
