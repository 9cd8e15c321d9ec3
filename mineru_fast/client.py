"""Python clients of the HTTP service (``mineru-fast serve``): ``Client`` and ``AsyncClient``.

Both keep one ``httpx`` connection pool (keep-alive), send the API key as ``Authorization: Bearer``,
and retry what is worth retrying: connection errors (a server restarting), ``429``, ``502``,
``503`` and ``504``, and any ``5xx`` that does not carry the service's JSON error body (a proxy's
answer, such as Ray Serve's plain-text ``500`` when the replica handling the request dies), waiting
exactly ``Retry-After`` when the service says it and an exponential backoff with jitter otherwise,
within ``RetryPolicy``'s bounds. Every other error is raised at once as a ``ServiceError``
subclass built from the service's JSON error body (``mineru_fast.errors``).

A job submission (``POST /v1/jobs``) carries an ``Idempotency-Key`` header, a new random one per
``submit`` (or ``parse``) call and the same one on each retry of it, so a submission whose answer
was lost (connection broken after the upload, a proxy's ``500``) and that is sent again gets the
job it made back, not a second job. ``parse`` submits a job and polls it; if the job is gone (the
server restarted and lost its in-memory queue, or cancelled it while shutting down) the document
is submitted again, under a new key. A ``POST /v1/document/parse`` (``use_jobs=False``) whose
connection broke after it was sent is sent again too, so the service may parse that document twice
(parsing has no side effects). Very large images are made smaller before upload
(``mineru_fast.inputs.upload``). Results are the service's JSON, as dicts.

>>> with Client("http://127.0.0.1:8000", api_key="...") as client:
...     result = client.parse("paper.pdf", pages="1-3")
...     print(result["markdown"])
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import os
import random
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from mineru_fast._version import __version__
from mineru_fast.errors import (
    AuthenticationFailed,
    DocumentRejected,
    InputError,
    JobFailed,
    JobNotFound,
    RateLimited,
    ServiceError,
    ServiceUnavailable,
    ServiceUnreachable,
)
from mineru_fast.inputs.documents import parse_page_range
from mineru_fast.inputs.upload import Upload, UploadPolicy, UploadSource, prepare_upload

__all__ = ["Client", "AsyncClient", "RetryPolicy", "UploadPolicy", "error_from_response", "DEFAULT_URL", "API_KEY_ENV"]

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "MINERU_FAST_API_KEY"
_FINISHED = ("done", "failed", "cancelled")
_STATUS_ERRORS: dict[int, type[ServiceError]] = {
    401: AuthenticationFailed,
    404: JobNotFound,
    413: DocumentRejected,
    422: DocumentRejected,
    429: RateLimited,
    503: ServiceUnavailable,
}
_NOT_RETRIED_CODES = frozenset({"model_load_failed"})  # a 503 that waiting does not cure


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures are retried, and how long the client waits.

    Attributes:
        attempts: most tries of one request, the first included.
        backoff: first wait (seconds) when the service gives no ``Retry-After``; doubled per retry,
            then a random part of up to half of it is taken off (jitter, so clients spread out).
        max_backoff: ceiling of one such wait (seconds).
        budget: most seconds one request spends waiting between tries; a ``Retry-After`` that
            would pass it ends the request at once with the error (its ``retry_after`` says how long).
        statuses: HTTP statuses retried.
        proxy_errors: also retry a ``5xx`` answer without the service's JSON error body: a proxy
            in front of the service failed the request (Ray Serve answers a plain-text ``500``
            when the replica handling it dies; the request produced no result).
    """

    attempts: int = 10
    backoff: float = 0.5
    max_backoff: float = 20.0
    budget: float = 300.0
    statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    proxy_errors: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff < 0 or self.max_backoff < 0 or self.budget < 0:
            raise ValueError("backoff, max_backoff and budget must be >= 0")


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date, RFC 9110 10.2.3), or None."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _service_error(response: httpx.Response) -> tuple[str, str, str | None] | None:
    """``(code, message, request_id)`` of the service's JSON error body; None for any other body."""
    try:
        body = response.json()["error"]
        return str(body["code"]), str(body["message"]), body.get("request_id")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _from_proxy(response: httpx.Response) -> bool:
    """A ``5xx`` the service did not write (no JSON error body): a proxy in front of it failed."""
    return response.status_code >= 500 and _service_error(response) is None


def error_from_response(response: httpx.Response, *, tries: int = 1) -> ServiceError:
    """The typed error for an error response (the service's ``{"error": {...}}`` body, or any other).

    A ``5xx`` without the service's body (``_from_proxy``) becomes ``ServiceUnavailable`` with
    code ``http_<status>`` and a message that says so.

    Args:
        response: the error answer.
        tries: requests made, this one included (named in a proxy error's message).

    Returns:
        The ``ServiceError`` subclass for the status (``mineru_fast.errors``).
    """
    status, request_id = response.status_code, response.headers.get("x-request-id")
    parsed = _service_error(response)
    if parsed is not None:
        code, message, request_id = parsed[0], parsed[1], parsed[2] or request_id
        cls = _STATUS_ERRORS.get(status, ServiceError)
        if cls is JobNotFound and code != "job_not_found":  # an unknown route, not a job
            cls = ServiceError
    elif _from_proxy(response):
        code, cls = f"http_{status}", ServiceUnavailable
        message = (
            f"{status} {response.reason_phrase} from a proxy in front of the service, not from the service "
            f"(Ray Serve answers so when the replica handling the request dies), {tries} tries made"
        )
        if response.text:
            message += f": {response.text[:200]}"
    else:
        code, message = f"http_{status}", response.text[:300] or response.reason_phrase
        cls = ServiceError if status == 404 else _STATUS_ERRORS.get(status, ServiceError)
    return cls(message, status=status, code=code, request_id=request_id, retry_after=_retry_after(response))


class _Retries:
    """The waits of one request under a ``RetryPolicy`` (I/O-free, shared by both clients)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy, self.tries, self.waited = policy, 0, 0.0

    def _fits(self, wait: float) -> float | None:
        if self.tries >= self.policy.attempts or self.waited + wait > self.policy.budget:
            return None
        self.waited += wait
        return wait

    def _backoff(self) -> float:
        full = min(self.policy.max_backoff, self.policy.backoff * 2 ** (self.tries - 1))
        return full - random.uniform(0, full / 2)

    def after_response(self, response: httpx.Response) -> float | None:
        """Seconds to wait before trying again after an error ``response``; None: give up."""
        self.tries += 1
        if response.status_code not in self.policy.statuses and not (
            self.policy.proxy_errors and _from_proxy(response)
        ):
            return None
        if response.status_code == 503 and error_from_response(response).code in _NOT_RETRIED_CODES:
            return None
        after = _retry_after(response)
        return self._fits(self._backoff() if after is None else after)

    def after_error(self) -> float | None:
        """Seconds to wait after a transport error (no answer); None: give up."""
        self.tries += 1
        return self._fits(self._backoff())


def _form(pages: str | None, password: str | None, formats: Iterable[str] | None) -> dict[str, str]:
    fields = {"pages": pages, "password": password, "formats": ",".join(formats) if formats is not None else None}
    return {key: value for key, value in fields.items() if value is not None}


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": f"mineru-fast-client/{__version__}"}
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _job_failed(status: dict[str, Any]) -> JobFailed:
    error = status.get("error") or {}
    return JobFailed(
        f"job {status.get('job_id')} {status.get('status')}: {error.get('message', 'no reason given')}",
        code=str(error.get("code", status.get("status", ""))),
    )


def _lost(exc: ServiceError) -> bool:
    """A job the service no longer has (restarted) or cancelled at shutdown: worth submitting again."""
    return isinstance(exc, JobNotFound) or exc.code == "shutting_down"


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# The client's logic is written once, free of I/O, as generators that yield what they need done:
# an HTTP request (answered with the response, or a TransportError thrown in), a pause, or a
# blocking call (Pillow's re-encoding). ``Client`` performs these with httpx.Client and
# time.sleep, ``AsyncClient`` with httpx.AsyncClient, asyncio.sleep and a worker thread.
@dataclass(frozen=True)
class _Http:
    method: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Call:
    function: Callable[..., Any]
    args: tuple[Any, ...]


_T = TypeVar("_T")
_Flow = Generator["_Http | _Sleep | _Call", Any, _T]


class _Base:
    """Settings and I/O-free logic shared by both clients (see ``Client`` for the arguments)."""

    def __init__(self, retries: RetryPolicy | None, upload: UploadPolicy | None, poll_interval: float,
                 resubmits: int) -> None:  # fmt: skip
        if poll_interval <= 0 or resubmits < 0:
            raise ValueError("poll_interval must be > 0 and resubmits >= 0")
        self.retries = retries or RetryPolicy()
        self.upload = upload or UploadPolicy()
        self.poll_interval = poll_interval
        self.resubmits = resubmits

    def _request(self, method: str, path: str, **kwargs: Any) -> _Flow[httpx.Response]:
        """One request under the retry policy; the response when it succeeded.

        Raises:
            ServiceError: the typed error of the last answer; ``ServiceUnreachable`` without one.
        """
        retries = _Retries(self.retries)
        while True:
            try:
                response = yield _Http(method, path, kwargs)
            except httpx.TransportError as exc:
                wait = retries.after_error()
                if wait is None:
                    raise ServiceUnreachable(
                        f"{method} {path}: no answer after the retries ({type(exc).__name__}: {exc})",
                        code="unreachable",
                    ) from exc
            else:
                if response.is_success:
                    return response
                wait = retries.after_response(response)
                if wait is None:
                    raise error_from_response(response, tries=retries.tries)
            yield _Sleep(wait)

    def _json(self, method: str, path: str, **kwargs: Any) -> _Flow[dict[str, Any]]:
        response = yield from self._request(method, path, **kwargs)
        return response.json()

    def _upload(self, source: UploadSource) -> _Flow[Upload]:
        return (yield _Call(prepare_upload, (source, self.upload)))

    def _submit(self, upload: Upload, form: dict[str, str], key: str | None = None) -> _Flow[dict[str, Any]]:
        """``POST /v1/jobs`` under ``key`` (default a new UUID4), the same key on every retry."""
        files = {"file": (upload.name, upload.data, "application/octet-stream")}
        headers = {"Idempotency-Key": str(uuid.uuid4()) if key is None else key}
        return (yield from self._json("POST", "/v1/jobs", files=files, data=form, headers=headers))

    def _submit_source(self, source: UploadSource, form: dict[str, str], key: str | None) -> _Flow[dict[str, Any]]:
        upload = yield from self._upload(source)
        return (yield from self._submit(upload, form, key))

    def _wait(self, job_id: str, timeout: float | None) -> _Flow[dict[str, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = yield from self._json("GET", f"/v1/jobs/{job_id}")
            if status["status"] == "done":
                return (yield from self._json("GET", f"/v1/jobs/{job_id}/result"))
            if status["status"] in _FINISHED:
                raise _job_failed(status)
            if deadline is not None and time.monotonic() + self.poll_interval > deadline:
                raise TimeoutError(f"job {job_id} is still {status['status']} after {timeout} s")
            yield _Sleep(self.poll_interval)

    def _parse(
        self, source: UploadSource, form: dict[str, str], timeout: float | None, use_jobs: bool
    ) -> _Flow[dict[str, Any]]:
        upload = yield from self._upload(source)
        if not use_jobs:
            files = {"file": (upload.name, upload.data, "application/octet-stream")}
            result = yield from self._json("POST", "/v1/document/parse", files=files, data=form, timeout=timeout)
            return _noting_clamped(form.get("pages"), result)
        deadline = None if timeout is None else time.monotonic() + timeout
        submitted = 0
        while True:
            job = yield from self._submit(upload, form)  # a new key: the lost job's may still name it
            submitted += 1
            try:
                return _noting_clamped(form.get("pages"), (yield from self._wait(job["job_id"], _left(deadline))))
            except (JobNotFound, JobFailed) as exc:
                if not _lost(exc) or submitted > self.resubmits:
                    raise


def _noting_clamped(pages: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """``result``, after logging the warning a local parse logs when the service clamped ``pages``
    to the document (``inputs.parse_page_range``; the result's metadata has its page count)."""
    count = ((result.get("metadata") or {}).get("input") or {}).get("page_count")
    if pages and isinstance(count, int) and count > 0:
        with contextlib.suppress(InputError):  # the service parsed it: nothing to refuse here
            parse_page_range(pages, count)
    return result


class Client(_Base):
    """Synchronous client of ``mineru-fast serve`` (thread-safe, as ``httpx.Client`` is).

    Args:
        base_url: the service, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer``; default ``$MINERU_FAST_API_KEY`` (none if unset).
        timeout: seconds per request (connect, read, write, pool) or an ``httpx.Timeout``; the
            waiting endpoint (``parse(use_jobs=False)``) reads for up to ``parse``'s ``timeout``.
        retries: what is retried and how long it waits (``RetryPolicy()``).
        upload: when images are re-encoded before upload (``UploadPolicy()``).
        poll_interval: seconds between job status requests.
        resubmits: times ``parse`` submits a document again when its job is lost (server restart).
        transport: an ``httpx`` transport (tests, proxies, Unix sockets); default httpx's.

    Raises:
        ValueError: ``poll_interval`` <= 0 or ``resubmits`` < 0.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 30.0,
        retries: RetryPolicy | None = None,
        upload: UploadPolicy | None = None,
        poll_interval: float = 1.0,
        resubmits: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(retries, upload, poll_interval, resubmits)
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def _run(self, flow: _Flow[_T]) -> _T:
        """Perform a flow's requests, pauses and calls in this thread; its return value."""
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Sleep):
                    time.sleep(op.seconds)
                    op = flow.send(None)
                elif isinstance(op, _Call):
                    op = flow.send(op.function(*op.args))
                else:
                    try:
                        response = self._http.request(op.method, op.path, **op.kwargs)
                    except httpx.TransportError as exc:
                        op = flow.throw(exc)
                    else:
                        op = flow.send(response)
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        """``GET /health``: the process answers."""
        return self._run(self._json("GET", "/health"))

    def ready(self) -> dict[str, Any]:
        """``GET /ready``: model loaded and engine check passed (``ServiceUnavailable`` until then,
        after the retry policy's waits; at once after a failed start or canary page). The JSON says
        the canary page's ``mode`` and ``state`` (``pending``, ``running``, ``passed``, ``failed``,
        ``off``), and its ``seconds`` once done."""
        return self._run(self._json("GET", "/ready"))

    def submit(
        self,
        source: UploadSource,
        *,
        pages: str | None = None,
        password: str | None = None,
        formats: Iterable[str] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/jobs``: queue a document; returns the job (``job_id``, ``status``, ...).

        The request carries ``Idempotency-Key``, the same on each retry, so retries never make a
        second job: a repeat the service already accepted returns that job.

        Args:
            source: file path, bytes, binary file object or PIL image (images over the upload
                policy are re-encoded first).
            pages: 1-based page range, e.g. ``"1-3,5"``; None = every page.
            password: user password of an encrypted PDF.
            formats: result parts among ``markdown``, ``middle_json``, ``structured_content``,
                ``content_list``, ``json``, ``layout``; None = the service's default (Markdown and
                the middle JSON, MinerU 4's bundle).
            idempotency_key: 1-255 printable ASCII characters naming this submission, to submit it
                again later (e.g. from another process) without making a second job; default a
                new random UUID4 per call. The service keeps it as long as the job (its result TTL).

        Raises:
            DocumentRejected: the document or a field was refused; also ``422
                idempotency_key_reused`` when ``idempotency_key`` named another request before.
            RateLimited, ServiceUnavailable, ServiceUnreachable: still so after the retries.
            AuthenticationFailed: missing or wrong API key. InputError: ``source`` cannot be read.
            ServiceError: ``400 invalid_idempotency_key`` for a malformed ``idempotency_key``.
        """
        return self._run(self._submit_source(source, _form(pages, password, formats), idempotency_key))

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job_id}``: status, queue position and pages done.

        Raises:
            JobNotFound: unknown, another key's, expired, or lost in a server restart.
        """
        return self._run(self._json("GET", f"/v1/jobs/{job_id}"))

    def result(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job_id}/result`` of a finished job.

        Raises:
            JobNotFound: see ``job``. ServiceError: ``409 job_not_finished`` while it runs, or the
                job's own error.
        """
        return self._run(self._json("GET", f"/v1/jobs/{job_id}/result"))

    def wait(self, job_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Poll a job every ``poll_interval`` seconds until it is finished; its result.

        Args:
            job_id: the ``job_id`` returned by ``submit``.
            timeout: most seconds to poll; None = no limit.

        Raises:
            JobFailed: the job ended ``failed`` or ``cancelled``. JobNotFound: see ``job``.
            TimeoutError: ``timeout`` passed first.
        """
        return self._run(self._wait(job_id, timeout))

    def parse(
        self,
        source: UploadSource,
        *,
        pages: str | None = None,
        password: str | None = None,
        formats: Iterable[str] | None = None,
        timeout: float | None = None,
        use_jobs: bool = True,
    ) -> dict[str, Any]:
        """Parse one document on the service; its result (``status``, ``pages``, ``markdown``, ...).

        With ``use_jobs`` (default) the document is submitted as a job and polled, so no request
        stays open for the whole parse (its retries make one job, see ``submit``); a job lost to a
        server restart (or cancelled by a shutdown) is submitted again as a new job, at most
        ``resubmits`` times. Otherwise one ``POST /v1/document/parse`` waits for the result.

        Args:
            source / pages / password / formats: as for ``submit``.
            timeout: most seconds to wait for the result; None = no limit (with ``use_jobs=False``
                the read timeout of the waiting request).
            use_jobs: submit and poll (True) or one waiting request (False).

        Raises:
            DocumentRejected, JobFailed, RateLimited, ServiceUnavailable, ServiceUnreachable, AuthenticationFailed: see
                ``submit`` and ``wait``. TimeoutError: ``timeout`` passed.
        """
        return self._run(self._parse(source, _form(pages, password, formats), timeout, use_jobs))


class AsyncClient(_Base):
    """Asynchronous client of ``mineru-fast serve`` (``asyncio``): ``Client``'s arguments and
    methods, as coroutines (``aclose`` for ``close``; ``transport`` an ``httpx.AsyncBaseTransport``).
    Image re-encoding runs in a worker thread, off the event loop."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 30.0,
        retries: RetryPolicy | None = None,
        upload: UploadPolicy | None = None,
        poll_interval: float = 1.0,
        resubmits: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(retries, upload, poll_interval, resubmits)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport
        )

    async def _run(self, flow: _Flow[_T]) -> _T:
        """Perform a flow's requests, pauses and calls on the event loop; its return value."""
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Sleep):
                    await asyncio.sleep(op.seconds)
                    op = flow.send(None)
                elif isinstance(op, _Call):
                    op = flow.send(await asyncio.to_thread(op.function, *op.args))
                else:
                    try:
                        response = await self._http.request(op.method, op.path, **op.kwargs)
                    except httpx.TransportError as exc:
                        op = flow.throw(exc)
                    else:
                        op = flow.send(response)
        except StopIteration as done:
            return done.value

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def health(self) -> dict[str, Any]:
        """See ``Client.health``."""
        return await self._run(self._json("GET", "/health"))

    async def ready(self) -> dict[str, Any]:
        """See ``Client.ready``."""
        return await self._run(self._json("GET", "/ready"))

    async def submit(
        self,
        source: UploadSource,
        *,
        pages: str | None = None,
        password: str | None = None,
        formats: Iterable[str] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """See ``Client.submit``."""
        return await self._run(self._submit_source(source, _form(pages, password, formats), idempotency_key))

    async def job(self, job_id: str) -> dict[str, Any]:
        """See ``Client.job``."""
        return await self._run(self._json("GET", f"/v1/jobs/{job_id}"))

    async def result(self, job_id: str) -> dict[str, Any]:
        """See ``Client.result``."""
        return await self._run(self._json("GET", f"/v1/jobs/{job_id}/result"))

    async def wait(self, job_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """See ``Client.wait``."""
        return await self._run(self._wait(job_id, timeout))

    async def parse(
        self,
        source: UploadSource,
        *,
        pages: str | None = None,
        password: str | None = None,
        formats: Iterable[str] | None = None,
        timeout: float | None = None,
        use_jobs: bool = True,
    ) -> dict[str, Any]:
        """See ``Client.parse``."""
        return await self._run(self._parse(source, _form(pages, password, formats), timeout, use_jobs))
