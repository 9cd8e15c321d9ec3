"""The one exception hierarchy of mineru-fast.

``MineruFastError`` is the root. Input problems (``InputError`` and its subclasses) concern one
document and make the CLI exit with status 2; ``ModelLoadError`` concerns the model;
``ServiceError`` and its subclasses are what ``mineru_fast.client`` raises for the HTTP service's
answers. Errors chain the underlying library exception with ``raise ... from``.

Every class has a stable machine-readable ``code`` (class attribute, ``snake_case``): results carry
it as ``ParseError.code`` and the service answers it as ``{"error": {"code"}}``. The message
(``str(exc)``) is a sentence for people and does not repeat the class name.
"""

from __future__ import annotations

__all__ = [
    "MineruFastError",
    "InputError",
    "UnsupportedFormat",
    "NativeDocument",
    "CorruptDocument",
    "PasswordRequired",
    "ImageTooLarge",
    "PageRangeError",
    "RenderTimeout",
    "SourceError",
    "TooManyPages",
    "DocumentNotFound",
    "OutputError",
    "ModelLoadError",
    "ModelNotCached",
    "LayoutModelMissing",
    "GgufError",
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
    "DOCUMENT_ERRORS",
    "error_code",
]


class MineruFastError(Exception):
    """Base class of every error raised by mineru-fast.

    Attributes:
        code: the class's stable machine-readable code; ``"error"`` here, where no more specific
            class applies (e.g. a usage error of the command line).
    """

    code = "error"


class InputError(MineruFastError):
    """A document cannot be read (one document fails, never the whole batch)."""

    code = "invalid_document"


class UnsupportedFormat(InputError):
    """The bytes are neither a PDF nor an image format Pillow can read."""

    code = "unsupported_format"


class NativeDocument(UnsupportedFormat):
    """An office, ODF, EPUB, HTML, RTF, OFD or CSV document: MinerU 4 parses these natively at its
    ``flash`` tier (DocVortex reads their own structure, no model), which mineru-fast, a runner of
    the MinerU2.5 model on page images, does not do; the message names the tool that does."""

    code = "native_document"


class CorruptDocument(InputError):
    """The file looks like a supported format but cannot be decoded (empty, truncated, damaged)."""

    code = "corrupt_document"


class PasswordRequired(InputError):
    """The PDF is encrypted and no password, or a wrong one, was given."""

    code = "password_required"


class ImageTooLarge(InputError):
    """An image or rendered page exceeds the configured pixel limit (decompression-bomb guard)."""

    code = "image_too_large"


class RenderTimeout(InputError):
    """A PDF page took longer than ``render_timeout`` seconds to render (its render process was
    killed; the page fails alone)."""

    code = "render_timeout"


class PageRangeError(InputError):
    """A page range such as ``"1-3,5"`` is malformed or outside the document."""

    code = "bad_page_range"


class TooManyPages(InputError):
    """More pages are selected than one parse takes (``ParserOptions.max_pages``; a few hundred
    bytes of PDF can claim a million pages)."""

    code = "too_many_pages"


class DocumentNotFound(InputError, FileNotFoundError):
    """The document's path does not exist. Also a ``FileNotFoundError``; the message is
    ``"no such file: <path>"`` wherever it is raised (``DocumentParser``, ``mineru_fast.client``)."""

    code = "document_not_found"


class SourceError(InputError):
    """An input location cannot be listed or read: a URI scheme pyarrow has no filesystem for, a
    path that does not exist, a store that cannot be reached (``mineru-fast batch`` inputs)."""

    code = "source_unreadable"


class OutputError(MineruFastError, OSError):
    """The outputs cannot be written: a folder that cannot be created or is a file, no permission,
    a full disk. Also an ``OSError`` (the error of the operating system is chained); ``mineru-fast
    parse`` stops with its own exit status and leaves no half-written output."""

    code = "output_error"


class ModelLoadError(MineruFastError):
    """A model directory or hub id cannot be resolved or loaded."""

    code = "model_load_failed"


class ModelNotCached(ModelLoadError):
    """Offline (``HF_HUB_OFFLINE=1``, ``--offline``, ``local_files_only=True``) and the model, the
    revision asked for, or some of its files are not in the local Hugging Face cache; the message
    names what is missing and the cache folder that was searched."""

    code = "model_not_cached"


class LayoutModelMissing(ModelLoadError):
    """The layout detector's weights (PP-DocLayoutV2, for ``tier="standard"``) are not on this
    machine and cannot be downloaded; the message says what to download and where it was looked
    for."""

    code = "layout_model_missing"


class GgufError(ModelLoadError):
    """A GGUF language model cannot be put into a MinerU2.5 checkpoint: the optional ``gguf``
    package is missing, or the file's architecture, hyper-parameters, vocabulary, tensors or
    output head do not fit (the message says which)."""

    code = "gguf_unusable"


class TraceError(MineruFastError):
    """A replay trace file is malformed or does not fit the document it is applied to."""

    code = "bad_replay_trace"


class BenchmarkError(MineruFastError):
    """A benchmark run was asked for something it cannot do (more pages than the workload has,
    a row filter that matches no row)."""

    code = "bad_benchmark_request"


DOCUMENT_ERRORS: tuple[type[MineruFastError], ...] = (InputError, TraceError)
"""Errors about the document given (its bytes, page range, password or replay trace): the service
answers them ``422`` with their code and message; any other error there is ``500 internal_error``."""


def error_code(exc: BaseException, default: str = "internal_error") -> str:
    """The stable code of ``exc``: its ``code`` for a mineru-fast error, ``default`` for any other."""
    return exc.code if isinstance(exc, MineruFastError) else default


class ServiceError(MineruFastError):
    """The HTTP service answered with an error, or could not be reached (``mineru_fast.client``).

    The service's error body is ``{"error": {"code", "message", "request_id"}}``; its fields are
    kept here, and ``str(exc)`` is the message alone (the same words as a local parse's error
    for the same document).

    Attributes:
        message: the service's message (or what went wrong on the way).
        status: HTTP status; None when no answer came.
        code: the service's stable error code (``"queue_full"``, ``"corrupt_document"``, ...);
            ``"unreachable"`` without an answer, ``"http_<status>"`` for a body not in that form;
            the class's ``code`` when none is given.
        request_id: the service's request id (its ``X-Request-ID``), for its logs.
        retry_after: seconds the service asked to wait (``Retry-After``), if it said.
    """

    code = "service_error"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        code = code or self.code
        super().__init__(message)  # str(exc) is the message alone, as every mineru-fast error's
        self.message, self.status, self.code = message, status, code
        self.request_id, self.retry_after = request_id, retry_after


class ServiceUnreachable(ServiceError):
    """No answer: connection refused or broken, or a timeout, after every retry."""

    code = "unreachable"


class AuthenticationFailed(ServiceError):
    """``401``: the API key is missing or not valid."""

    code = "authentication_failed"


class DocumentRejected(ServiceError, InputError):
    """``413`` / ``422``: the service refused the document or its fields (format, corruption,
    password, page range, size); ``code`` says which. Also an ``InputError``, as a local parse's."""

    code = "document_rejected"


class JobNotFound(ServiceError):
    """``404``: unknown job id, another key's job, or its result expired (or the server restarted)."""

    code = "job_not_found"


class JobFailed(ServiceError):
    """A job ended ``failed`` or ``cancelled``; ``code`` and ``message`` are the job's error."""

    code = "job_failed"


class RateLimited(ServiceError):
    """``429`` after every retry: the queue is full or the key is over its rate (``retry_after``)."""

    code = "rate_limited"


class ServiceUnavailable(ServiceError):
    """``503`` after every retry: the model is loading or failed to load, or the server is shutting
    down; or a ``5xx`` that a proxy in front of the service answered instead of it (no JSON error
    body, e.g. Ray Serve's ``500`` when the replica handling the request died), after every retry."""

    code = "service_unavailable"
