"""API keys, per-key token-bucket rate limits and the streaming upload-size limit.

Key file grammar, one entry per line (UTF-8, with or without a byte order mark)::

    # a comment: a line whose first non-blank character is '#'
    NAME:SECRET
    NAME:SECRET:RATE

- ``NAME``: 1-64 of ``A-Z a-z 0-9 . _ -``; names the key in logs and metrics.
- ``SECRET``: 8-256 printable ASCII characters other than ``:`` and whitespace; a ``#`` is part
  of the secret (there are no comments after an entry).
- ``RATE``: this key's requests per minute, a plain decimal number >= 0 (``30``, ``0.5``; ``0`` =
  unlimited); without it the server-wide ``--rate-limit`` applies.
- Spaces and tabs around fields and at the ends of a line are ignored; blank lines too.

Anything else (a wrong field count, a secret with a space, ``nan``, ``inf``, ``-1``, ``1e3``, a
repeated name or secret) stops the server at start-up with the line number, never the line's text.

Clients send the secret as ``Authorization: Bearer SECRET`` or ``X-API-Key: SECRET``. Secrets are
compared in constant time and never logged; logs and metrics name the key by ``NAME``.

``GuardMiddleware`` is a plain ASGI middleware placed in front of the application, so a request
is refused before its body is read: wrong or missing key -> ``401``, over the rate -> ``429`` with
``Retry-After``, a declared ``Content-Length`` over the limit -> ``413`` at once, a streamed
body that passes the limit -> ``413`` as soon as it does, and a body that pauses longer than the
read timeout, or that after that long still averages less than the minimum rate, -> ``408``
(the connection is then closed, so the rest of the body is never read). The bodies of the
requests in flight together hold at most a budget of bytes (``BodyBudget``), each API key at most
a share of it: a request whose body would pass either is refused before that body is buffered.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mineru_fast.serve.errors import error_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "ApiKey",
    "load_api_keys",
    "KeyRing",
    "TokenBucket",
    "RateLimiter",
    "BodyBudget",
    "GuardMiddleware",
    "PROTECTED_PREFIX",
]

PROTECTED_PREFIX = "/v1/"
"""Paths under this prefix need a key (when keys are configured) and count against rate limits."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class ApiKey:
    """One API key: its public ``name``, the ``secret``'s SHA-256 digest and an optional own rate.

    Attributes:
        name: identifies the key in logs and metrics.
        digest: SHA-256 of the secret (the secret itself is not kept).
        rate: requests per minute for this key; None = the server-wide rate.
    """

    name: str
    digest: bytes
    rate: float | None = None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


_KEY_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY_SECRET = re.compile(r"[!-9;-~]{8,256}")  # printable ASCII without space and ':'
_KEY_RATE = re.compile(r"\d{1,9}(\.\d{1,6})?")


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """Read an API key file (grammar in the module docstring).

    Raises:
        ValueError: unreadable file, a line outside the grammar (reported by line number, never
            by content), a duplicate name or secret, or no key at all.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte order mark (some editors write one) is dropped
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from exc
    keys: list[ApiKey] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}, line {number}"
        parts = [p.strip() for p in line.split(":")]
        if len(parts) not in (2, 3):
            raise ValueError(f"{where}: expected NAME:SECRET or NAME:SECRET:RATE (comments go on their own line)")
        if not _KEY_NAME.fullmatch(parts[0]):
            raise ValueError(f"{where}: NAME must be 1-64 of A-Z a-z 0-9 . _ -")
        if not _KEY_SECRET.fullmatch(parts[1]):
            raise ValueError(
                f"{where}: SECRET must be 8-256 printable ASCII characters without spaces or ':' "
                "(comments go on their own line)"
            )
        rate = None
        if len(parts) == 3:
            if not _KEY_RATE.fullmatch(parts[2]):
                raise ValueError(f"{where}: RATE must be a plain number of requests per minute >= 0, e.g. 30 or 0.5")
            rate = float(parts[2])
        keys.append(ApiKey(parts[0], _digest(parts[1]), rate))
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    if len({k.name for k in keys}) != len(keys) or len({k.digest for k in keys}) != len(keys):
        raise ValueError(f"API key file {path} repeats a key name or secret")
    return keys


class KeyRing:
    """Looks up the key a request presents, in constant time per key.

    Args:
        keys: the accepted keys; empty means no key is required.
    """

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = list(keys)

    @property
    def required(self) -> bool:
        """True when requests to protected paths must present a key."""
        return bool(self.keys)

    def identify(self, secret: str) -> ApiKey | None:
        """The key whose secret this is, or None."""
        digest = _digest(secret)
        found = None
        for key in self.keys:  # compare with every key so timing does not depend on which matched
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found


class TokenBucket:
    """Token bucket: ``burst`` requests at once, refilled at ``rate_per_minute``.

    Args:
        rate_per_minute: refill rate; must be > 0.
        burst: bucket capacity (requests that may arrive together).
        clock: monotonic time source in seconds (injectable for tests).
    """

    def __init__(self, rate_per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_minute <= 0 or burst < 1:
            raise ValueError("rate_per_minute must be > 0 and burst >= 1")
        self.rate = rate_per_minute / 60.0
        self.capacity = float(burst)
        self.tokens = float(burst)
        self.clock = clock
        self.updated = clock()

    def take(self) -> float:
        """Take one token.

        Returns:
            0.0 when the request may go ahead, else the seconds until a token is available.
        """
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One ``TokenBucket`` per client identity, thread-safe, at most ``max_clients`` remembered.

    Args:
        rate_per_minute: default rate; 0 disables limiting for identities without their own rate.
        burst: bucket capacity.
        max_clients: least recently seen identities beyond this are forgotten (bounded memory).
        clock: monotonic time source.
    """

    def __init__(
        self,
        rate_per_minute: float,
        burst: int,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.burst, self.max_clients, self.clock = rate_per_minute, burst, max_clients, clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, identity: str, rate: float | None = None) -> float:
        """Count one request of ``identity``.

        Args:
            identity: key name, or client address when no keys are used.
            rate: this identity's own requests per minute; None = the default.

        Returns:
            0.0 if allowed, else the seconds the client should wait.
        """
        rate = self.rate if rate is None else rate
        if rate <= 0:
            return 0.0
        with self._lock:
            bucket = self._buckets.get(identity)
            if bucket is None:
                bucket = self._buckets[identity] = TokenBucket(rate, self.burst, self.clock)
                while len(self._buckets) > self.max_clients:
                    self._buckets.popitem(last=False)
            self._buckets.move_to_end(identity)
            return bucket.take()


class BodyRefused(Exception):
    """Raised into the application when a streamed body passes the size limit or stalls, or by
    ``BodyBudget.reserve``.

    Attributes:
        status / code / message: the answer sent instead of the application's.
        headers: extra headers of that answer (``Retry-After``).
    """

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):g} MiB"


class BodyBudget:
    """The request-body bytes the requests in flight may hold, in all and per API key.

    A request reserves its declared ``Content-Length`` before its body is read (a body sent
    without one reserves each chunk as it arrives) and gives it back once its response is sent:
    what its handler keeps of the body (an upload, the document of a synchronous parse) counts as
    long as the request runs. Only the event loop calls it.

    Args:
        capacity: bytes the bodies of all requests in flight may hold together.
        key_share: bytes those of one API key's requests may hold together, at most
            ``capacity`` (requests without a key share ``capacity`` only).
    """

    def __init__(self, capacity: int, key_share: int) -> None:
        self.capacity, self.key_share = capacity, key_share
        self.used = 0
        self._keys: dict[str, int] = {}

    def reserve(self, key: str | None, size: int) -> None:
        """Reserve ``size`` bytes (> 0) for a request of ``key`` (None: no API key).

        Raises:
            BodyRefused: 413 ``payload_too_large`` when ``size`` alone is over what the request
                may hold; 429 ``upload_buffer_quota`` when it would take the key's requests past
                ``key_share``, 503 ``upload_buffer_full`` when it would take all past
                ``capacity`` (both with ``Retry-After``). Nothing is reserved then.
        """
        held = self._keys.get(key, 0) if key is not None else 0
        limit = self.key_share if key is not None else self.capacity
        if size > limit:
            whose = "one API key's requests" if key is not None else "all requests"
            message = f"the request body exceeds the {_mib(limit)} of request bodies {whose} may hold at once"
            raise BodyRefused(413, "payload_too_large", message)
        retry = {"Retry-After": "1"}
        if held + size > limit:
            message = (
                f"this API key's requests in flight hold their share of {_mib(limit)} of request bodies; "
                "retry once one has been answered"
            )
            raise BodyRefused(429, "upload_buffer_quota", message, retry)
        if self.used + size > self.capacity:
            message = f"the server holds its {_mib(self.capacity)} of request bodies in flight; retry in 1 s"
            raise BodyRefused(503, "upload_buffer_full", message, retry)
        self.used += size
        if key is not None:
            self._keys[key] = held + size

    def release(self, key: str | None, size: int) -> None:
        """Give back ``size`` bytes reserved for a request of ``key``."""
        self.used -= size
        if key is not None:
            left = self._keys.pop(key) - size
            if left:
                self._keys[key] = left


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _presented_secret(scope: Scope) -> str | None:
    auth = _header(scope, b"authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    api_key = _header(scope, b"x-api-key")
    return api_key.strip() if api_key else None


async def send_error(
    send: Send, scope: Scope, status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> None:
    """Send a complete JSON error response (the service's error format) through raw ASGI.

    The request id is taken from ``scope["state"]["request_id"]`` (set by the request-context
    middleware, which also adds the ``X-Request-ID`` header).
    """
    request_id = scope.get("state", {}).get("request_id")
    body = error_bytes(code, message, request_id)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """ASGI middleware: API keys, rate limits, the upload-size limit and the budget of body bytes
    in flight, before the body is read.

    Sets ``scope["state"]["api_key"]`` to the key's name (or None) for the application.

    Args:
        app: the wrapped ASGI application.
        keyring: accepted keys (empty = open service).
        limiter: per-identity rate limiter.
        max_body: largest request body in bytes.
        body_timeout: longest pause in seconds while the body is read; also the grace period
            before ``min_body_rate`` applies.
        min_body_rate: bytes per second the body must average from ``body_timeout`` seconds after
            its request began (a client trickling bytes just within the pause limit is cut off).
        budget: the body bytes the requests in flight may hold (shared by the whole process).
    """

    def __init__(
        self,
        app: ASGIApp,
        keyring: KeyRing,
        limiter: RateLimiter,
        max_body: int,
        body_timeout: float,
        min_body_rate: float,
        budget: BodyBudget,
    ) -> None:
        self.app, self.keyring, self.limiter, self.max_body = app, keyring, limiter, max_body
        self.body_timeout, self.min_body_rate, self.budget = body_timeout, min_body_rate, budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["api_key"] = None
        if scope["path"].startswith(PROTECTED_PREFIX) and not await self._admit(scope, send):
            return
        declared = _header(scope, b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else 0
        if size > self.max_body:
            await self._too_large(send, scope)
            return
        if size:
            try:
                self.budget.reserve(state["api_key"], size)
            except BodyRefused as refusal:
                headers = {**refusal.headers, "Connection": "close"}  # the body is not read
                await send_error(send, scope, refusal.status, refusal.code, refusal.message, headers)
                return
        await self._call_limited(scope, receive, send, size, streamed=declared is None)

    async def _admit(self, scope: Scope, send: Send) -> bool:
        """Key and rate checks; sends the refusal and returns False when the request is refused."""
        state = scope["state"]
        rate = None
        if self.keyring.required:
            secret = _presented_secret(scope)
            key = self.keyring.identify(secret) if secret else None
            if key is None:
                code, message = (
                    ("invalid_api_key", "the API key is not valid")
                    if secret
                    else ("missing_api_key", "send an API key as 'Authorization: Bearer KEY' or 'X-API-Key: KEY'")
                )
                await send_error(send, scope, 401, code, message, {"WWW-Authenticate": "Bearer"})
                return False
            identity, rate = key.name, key.rate
            state["api_key"] = key.name
        else:
            client = scope.get("client")
            identity = f"address:{client[0] if client else 'unknown'}"
        wait = self.limiter.check(identity, rate)
        if wait > 0:
            retry = str(max(1, math.ceil(wait)))
            message = f"rate limit exceeded; retry in {retry} s"
            await send_error(send, scope, 429, "rate_limited", message, {"Retry-After": retry})
            return False
        return True

    def _too_large_message(self) -> str:
        return f"the request body exceeds the limit of {self.max_body / (1024 * 1024):g} MiB"

    async def _too_large(self, send: Send, scope: Scope) -> None:
        message = self._too_large_message()
        await send_error(send, scope, 413, "payload_too_large", message, {"Connection": "close"})

    async def _call_limited(self, scope: Scope, receive: Receive, send: Send, held: int, streamed: bool) -> None:
        """Run the application on a body read under the limits. ``held``: the bytes reserved for
        the body already (its ``Content-Length``); a ``streamed`` body (none declared) reserves
        each chunk as it comes. All are given back when the application returns."""
        key = scope["state"]["api_key"]
        received = 0
        body_done = False
        refused: BodyRefused | None = None
        started = False
        loop = asyncio.get_running_loop()
        begun = loop.time()

        async def limited_receive() -> Message:
            nonlocal received, body_done, refused, held
            if body_done:  # after the body only a disconnect can come: no timeout
                return await receive()
            # The next chunk must come within the pause limit, and before the average rate since
            # the grace period ended falls under the minimum.
            # (At least a moment: a chunk already buffered by the server is taken, not refused.)
            rate_deadline = begun + self.body_timeout + received / self.min_body_rate
            wait = max(0.05, min(self.body_timeout, rate_deadline - loop.time()))
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                refused = BodyRefused(
                    408,
                    "body_timeout",
                    f"the request body paused for more than {self.body_timeout:g} s or came slower than "
                    f"{self.min_body_rate:g} bytes/s",
                )
                raise refused from None
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                received += chunk
                body_done = not message.get("more_body", False)
                if received > self.max_body:
                    refused = BodyRefused(413, "payload_too_large", self._too_large_message())
                    raise refused
                if streamed and chunk:
                    try:
                        self.budget.reserve(key, chunk)
                    except BodyRefused as refusal:
                        refused = refusal
                        raise
                    held += chunk
            else:
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused is not None:  # the application's answer to the interrupted body is replaced
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyRefused:
            pass
        except Exception:
            if refused is None:
                raise
        finally:
            if held:
                self.budget.release(key, held)
        if refused is not None:
            logger.info(
                "upload refused",
                extra={"request_id": scope["state"].get("request_id"), "bytes_in": received, "code": refused.code},
            )
            if not started:
                headers = {**refused.headers, "Connection": "close"}
                await send_error(send, scope, refused.status, refused.code, refused.message, headers)
