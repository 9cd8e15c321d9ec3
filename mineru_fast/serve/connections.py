"""Connection-level guards under uvicorn: a header read timeout, a connection cap, quiet accept errors.

uvicorn closes idle kept-alive connections but sets no deadline on a request's headers and no cap
on open connections, so clients trickling a byte now and then hold sockets forever until the
process runs out of file descriptors (then every ``accept`` fails and asyncio logs each failure
with a traceback). ``guarded_protocol`` gives uvicorn's h11 protocol a deadline for the request
line and headers and a cap on open connections, which ``connection_limits`` keeps, with the
listen backlog, below the process's open-file limit;
``RateLimitedLogFilter`` keeps one accept-error line per interval. The body's read timeout is the
ASGI guard's (``security.GuardMiddleware``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_bytes

logger = logging.getLogger(__name__)

__all__ = ["GuardedH11Protocol", "guarded_protocol", "connection_limits", "RateLimitedLogFilter"]

ACCEPT_ERROR_PREFIX = "socket.accept() out of system resource"  # asyncio's message on EMFILE/ENFILE
_RESERVED_FDS = 32  # descriptors kept for the process itself (it uses about 10: logs, pipes, epoll)


def _reply(status: str, code: str, message: str, extra: bytes = b"") -> bytes:
    body = error_bytes(code, message, None)
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
    ).encode("latin-1")
    return head + extra + b"\r\n" + body


_TIMEOUT_REPLY = _reply("408 Request Timeout", "header_timeout", "the request headers did not arrive in time")
_BUSY_REPLY = _reply(
    "503 Service Unavailable", "too_many_connections", "the server has too many open connections", b"retry-after: 1\r\n"
)


class RateLimitedLogFilter(logging.Filter):
    """Lets through one record per ``interval`` seconds of those whose message starts with ``prefix``.

    The next record let through carries ``suppressed``: how many were dropped since the last one.
    Other records pass untouched.

    Args:
        prefix: start of the messages to limit.
        interval: seconds between two records let through.
        clock: monotonic time source (injectable for tests).
    """

    def __init__(self, prefix: str, interval: float = 10.0, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.prefix, self.interval, self.clock = prefix, interval, clock
        self._last: float | None = None
        self._suppressed = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """True to log ``record``."""
        if not str(record.msg).startswith(self.prefix):
            return True
        now = self.clock()
        with self._lock:
            if self._last is not None and now - self._last < self.interval:
                self._suppressed += 1
                return False
            self._last = now
            record.suppressed, self._suppressed = self._suppressed, 0
        record.exc_info, record.exc_text = None, None  # the same traceback every time: once in the message is enough
        return True


_REFUSED = "connection refused: too many open connections"
logger.addFilter(RateLimitedLogFilter(_REFUSED, interval=10.0))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (class attributes).

    Attributes:
        header_timeout: seconds from the connection opening (or the previous response ending) to
            the end of the next request's headers; then ``408`` and close.
        max_connections: open connections at most; one more is answered ``503`` and closed before
            anything is read.
    """

    header_timeout: float = 10.0
    max_connections: int = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection; refuse it over the cap, else start the header deadline."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning(_REFUSED, extra={"limit": self.max_connections})
            transport.write(_BUSY_REPLY)
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        """Feed h11; once a request's headers are in, its deadline is met."""
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        """After a response on a kept-alive connection the next request's headers get a new deadline."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the deadline, then uvicorn's own clean-up."""
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_REPLY)
            self.transport.close()


def connection_limits(requested: int) -> tuple[int, int]:
    """The connection cap and the listen backlog that keep the process below its open-file limit.

    asyncio accepts up to ``backlog`` connections in a row before any of them is seen (and
    refused over the cap), and a refused one frees its descriptor a loop turn later, so about three
    backlogs of descriptors may be in flight beyond the capped connections. With ``F`` the soft
    open-file limit and ``R`` = ``_RESERVED_FDS`` kept for the process itself: the cap is at most
    ``(F - R) / 2``, the backlog a quarter of what is left (at least 16, at most 2048).

    Returns:
        ``(max_connections, backlog)``; ``(requested, 2048)`` where the limit is unknown or infinite.
    """
    try:
        import resource
    except ImportError:  # not Unix: no limit to read
        return requested, 2048
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested, 2048
    room = max(2, soft - _RESERVED_FDS)
    cap = max(1, min(requested, room // 2))
    return cap, max(16, min(2048, (room - cap) // 4))


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` subclass with these settings, for ``uvicorn.Config(http=...)``."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )
