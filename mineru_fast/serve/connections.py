"""Connection-level guards under uvicorn: a header read timeout, a connection cap, a write timeout
and a cap on unread response bytes, quiet accept errors.

uvicorn closes idle kept-alive connections but sets no deadline on a request's headers and no cap
on open connections, so clients trickling a byte now and then hold sockets forever until the
process runs out of file descriptors (then every ``accept`` fails and asyncio logs each failure
with a traceback). ``guarded_protocol`` gives uvicorn's h11 protocol a deadline for the request
line and headers and a cap on open connections, which ``connection_limits`` keeps, with the
listen backlog, below the process's open-file limit (a connection over the cap is answered
``503``, then what it sends is read and dropped for a moment: closed with its request unread, the
kernel reset it and the client lost the answer), and a write timeout and a cap on the response
bytes its connections hold unread (clients that stop reading a large result held their
connection slot, and its bytes, for good); ``RateLimitedLogFilter`` keeps one accept-error line
per interval. The body's read timeout is the ASGI guard's (``security.GuardMiddleware``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mineru_fast.serve.errors import error_bytes

logger = logging.getLogger(__name__)

__all__ = ["GuardedH11Protocol", "guarded_protocol", "connection_limits", "RateLimitedLogFilter"]

ACCEPT_ERROR_PREFIX = "socket.accept() out of system resource"  # asyncio's message on EMFILE/ENFILE
_RESERVED_FDS = 32  # descriptors kept for the process itself (it uses about 10: logs, pipes, epoll)
_LINGER_SECONDS = 2.0  # a refused connection is read (and its bytes dropped) this long at most ...
_LINGER_BYTES = 1024 * 1024  # ... and this many bytes at most; then it is aborted


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
_WRITE_TIMED_OUT = "connection closed: the client stopped reading its response"
_OVER_BUFFER = "connection closed: unread responses over the buffer cap"
for _message in (_REFUSED, _WRITE_TIMED_OUT, _OVER_BUFFER):
    logger.addFilter(RateLimitedLogFilter(_message, interval=10.0))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap, a write timeout and a cap
    on unread response bytes (class attributes).

    uvicorn hands a response body to the transport in one write and the application is done; what
    the client has not read stays in the transport's buffer, and the connection open, for as long
    as the client keeps it. Here a connection whose buffer is over the transport's high-water mark
    (it is "paused") must drain at least ``write_timeout * min_write_rate`` bytes every
    ``write_timeout`` seconds, or it is aborted (its buffer freed); and when the paused
    connections together hold more than ``max_buffered`` bytes, those paused longest are aborted
    until they fit (never the last one, so a response larger than the cap is still served).

    Attributes:
        header_timeout: seconds from the connection opening (or the previous response ending) to
            the end of the next request's headers; then ``408`` and close.
        max_connections: open connections at most; one more is answered ``503`` at once, then
            lingers: what it sends is read and dropped (so closing it does not reset it, which
            loses the answer) until the client closes, for at most ``_LINGER_SECONDS`` and
            ``_LINGER_BYTES``; a listen backlog (``config.backlog``) of refused connections
            linger at once at most, more are closed at once. Lingering ones do not count
            against the cap.
        write_timeout: seconds a paused connection may go without draining ``min_write_rate``
            bytes per second of its buffer.
        min_write_rate: bytes per second a paused connection must drain.
        max_buffered: unread response bytes the paused connections may hold together.
    """

    header_timeout: float = 10.0
    max_connections: int = 128
    write_timeout: float = 30.0
    min_write_rate: float = 1024.0
    max_buffered: int = 256 * 1024 * 1024
    _paused: ClassVar[dict[GuardedH11Protocol, int]] = {}  # paused connections, oldest first: unread bytes
    _lingering: ClassVar[set[GuardedH11Protocol]] = set()  # refused connections still being read

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None  # a refused connection's: the end of its linger
        self._write_timer: asyncio.TimerHandle | None = None
        self._dropped: int | None = None  # bytes read and dropped since refused; None = not refused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection; refuse it over the cap, else start the header deadline."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse()
            return
        self._arm_header_timer()

    def _refuse(self) -> None:
        """Answer ``503``, send the end of the stream, then linger (see ``max_connections``)."""
        logger.warning(_REFUSED, extra={"limit": self.max_connections})
        self.connections.discard(self)
        self.transport.write(_BUSY_REPLY)
        if len(self._lingering) >= self.config.backlog:
            self.transport.close()
            return
        self._lingering.add(self)
        self._dropped = 0
        self.transport.write_eof()  # the client reads the answer, then the end: it closes, and so do we
        self._header_timer = self.loop.call_later(_LINGER_SECONDS, self._abort)

    def data_received(self, data: bytes) -> None:
        """Feed h11; once a request's headers are in, its deadline is met. A refused connection's
        bytes are dropped."""
        if self._dropped is not None:
            self._dropped += len(data)
            if self._dropped > _LINGER_BYTES:
                self._abort()
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        """After a response on a kept-alive connection the next request's headers get a new deadline."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the deadlines, then uvicorn's own clean-up."""
        self._disarm_header_timer()
        self._unpause()
        self._lingering.discard(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: watch it drain, and keep the paused
        connections' unread bytes under the cap."""
        super().pause_writing()
        self._paused[self] = self.transport.get_write_buffer_size()
        self._arm_write_timer()
        excess = sum(self._paused.values()) - self.max_buffered
        for connection in list(self._paused):  # oldest first
            if excess <= 0 or len(self._paused) <= 1:
                break
            excess -= self._paused[connection]
            logger.warning(_OVER_BUFFER, extra={"limit": self.max_buffered})
            connection._abort()

    def resume_writing(self) -> None:
        """The buffer drained below its low-water mark: no longer watched."""
        self._unpause()
        super().resume_writing()

    def _arm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
        self._write_timer = self.loop.call_later(self.write_timeout, self._write_deadline_passed)

    def _unpause(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._paused.pop(self, None)

    def _write_deadline_passed(self) -> None:
        self._write_timer = None
        if self not in self._paused:
            return
        left = self.transport.get_write_buffer_size()
        if self._paused[self] - left >= self.write_timeout * self.min_write_rate:
            self._paused[self] = left  # read on: watch the next interval
            self._arm_write_timer()
            return
        logger.warning(_WRITE_TIMED_OUT, extra={"seconds": self.write_timeout})
        self._abort()

    def _abort(self) -> None:
        """Drop the connection and its unread bytes (``connection_lost`` follows)."""
        self._unpause()
        self.transport.abort()

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
    backlogs of descriptors may be in flight beyond the capped connections, and one more backlog of
    refused connections lingers (``GuardedH11Protocol.max_connections``). With ``F`` the soft
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


def guarded_protocol(
    header_timeout: float,
    max_connections: int,
    write_timeout: float = GuardedH11Protocol.write_timeout,
    min_write_rate: float = GuardedH11Protocol.min_write_rate,
    max_buffered: int = GuardedH11Protocol.max_buffered,
) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` subclass with these settings (and its own registries of paused
    and lingering connections), for ``uvicorn.Config(http=...)``."""
    settings = {
        "header_timeout": header_timeout,
        "max_connections": max_connections,
        "write_timeout": write_timeout,
        "min_write_rate": min_write_rate,
        "max_buffered": max_buffered,
        "_paused": {},
        "_lingering": set(),
    }
    return type("GuardedH11Protocol", (GuardedH11Protocol,), settings)
