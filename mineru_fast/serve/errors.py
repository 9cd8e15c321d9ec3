"""The service's one error format and the mapping of exceptions to HTTP statuses.

Every error response has the body ``{"error": {"code", "message", "request_id"}}``: ``code`` is a
stable machine-readable string, ``message`` a sentence for people, ``request_id`` the value of the
response's ``X-Request-ID`` header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mineru_fast.errors import DOCUMENT_ERRORS

__all__ = ["ApiError", "error_body", "error_bytes", "from_exception"]


@dataclass(eq=False)
class ApiError(Exception):
    """An error answered to the client in the service's JSON format.

    Attributes:
        status: HTTP status code.
        code: stable error code, e.g. ``"queue_full"``.
        message: human-readable explanation (never document contents or secrets).
        headers: extra response headers, e.g. ``Retry-After``.
    """

    status: int
    code: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


def error_body(code: str, message: str, request_id: str | None) -> dict:
    """The JSON error object."""
    return {"error": {"code": code, "message": message, "request_id": request_id}}


def error_bytes(code: str, message: str, request_id: str | None) -> bytes:
    """The JSON error object, encoded."""
    return json.dumps(error_body(code, message, request_id), ensure_ascii=False).encode("utf-8")


def from_exception(exc: BaseException) -> ApiError:
    """Map an exception raised while checking or parsing a document to an ``ApiError``.

    mineru-fast input and trace errors (``errors.DOCUMENT_ERRORS``) become ``422`` with their
    ``code`` and message (which names the problem, not the contents; the same as a result's
    ``ParseError``); an ``ApiError`` is returned as is; anything else is a ``500``
    whose message reveals nothing internal.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, DOCUMENT_ERRORS):
        return ApiError(422, exc.code, str(exc))
    return ApiError(500, "internal_error", "the server failed to process the document; see its logs")
