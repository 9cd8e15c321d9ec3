"""Admission of a parse: check an upload from its headers, then queue it as a ``Job``.

Every door that parses documents (``/v1/document/parse``, ``/v1/jobs``, MinerU's document API in
``mineru_api``) queues through ``check_and_submit``, so they share the page and cost checks, the
queue and decode-budget bounds (``429`` with ``Retry-After``), the rejection metrics and the logs.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from mineru_fast.serve.errors import ApiError, from_exception
from mineru_fast.serve.jobs import Job, OverBudget, QueueFull, ShuttingDown
from mineru_fast.serve.parsing import ParseRequest, inspect_document
from mineru_fast.serve.service import Service

logger = logging.getLogger(__name__)

__all__ = ["check_and_submit", "request_id", "wait_for_job"]

# How often a waiting synchronous parse checks the drain's deadline: well within the 1 s that
# uvicorn gives open requests once a drain has run out (``server.DrainingServer``).
_DRAIN_POLL_SECONDS = 0.2


def request_id(request: Request) -> str | None:
    """The request's id (``X-Request-ID``, set by ``context.RequestContextMiddleware``)."""
    return getattr(request.state, "request_id", None)


async def check_and_submit(
    service: Service,
    request: Request,
    parse_request: ParseRequest,
    retain: bool,
    idempotency: tuple[str, str] | None = None,
) -> Job:
    """Inspect the document's headers off the event loop, then queue it.

    Args:
        retain: keep the job findable by id after it finished (False for synchronous calls).
        idempotency: ``(Idempotency-Key, ParseRequest.fingerprint())`` of a retained job, if sent.

    Raises:
        ApiError: 422 for a broken or unsupported document, 413 ``document_too_large`` when its
            decoded pages alone exceed the budget, 429 ``queue_full`` or ``over_capacity`` with
            ``Retry-After``, 503 when not ready or shutting down.
        AlreadySubmitted: the store holds a job of this API key with this ``Idempotency-Key``.
    """
    jobs = service.require_ready()
    try:
        info = await run_in_threadpool(
            inspect_document, parse_request, service.config.options, service.config.max_pages
        )
    except Exception as exc:
        error = from_exception(exc)
        if error.status >= 500:
            logger.exception("document check failed", extra={"request_id": request_id(request)})
        raise error from exc
    budget = service.config.decode_budget_bytes
    if info.cost > budget:
        service.metrics.observe_job("rejected", None, None, [])
        raise ApiError(
            413,
            "document_too_large",
            f"parsing needs {info.cost / 2**20:,.0f} MiB of decoded pages at once; this server's budget is "
            f"{budget / 2**20:,.0f} MiB",
        )
    job = Job(
        payload=parse_request,
        owner=request.state.api_key,
        request_id=request_id(request),
        pages_total=len(info.selected),
        cost=info.cost,
        retain=retain,
        idempotency_key=idempotency[0] if idempotency else None,
        fingerprint=idempotency[1] if idempotency else None,
    )
    try:
        await run_in_threadpool(jobs.submit, job)  # a retained job is recorded in the store first
    except QueueFull as exc:
        service.metrics.observe_job("rejected", None, None, [])
        retry = str(exc.retry_after)
        code, what = (
            ("over_capacity", "the server's decode budget is in use")
            if isinstance(exc, OverBudget)
            else ("queue_full", "the job queue is full")
        )
        raise ApiError(429, code, f"{what}; retry in {retry} s", {"Retry-After": retry}) from None
    except ShuttingDown:
        raise ApiError(503, "shutting_down", "the server is shutting down and takes no new jobs") from None
    logger.info(
        "job queued",
        extra={
            "job_id": job.id,
            "request_id": job.request_id,
            "format": info.format,
            "page_count": len(info.selected),
            "bytes_in": len(parse_request.data),
            "bytes_decoded": info.cost,
            "queue_length": jobs.queue_length,
        },
    )
    return job


async def wait_for_job(job: Job, service: Service, timeout: float | None = None) -> bool:
    """Wait, without blocking the event loop, until a worker has finished the job, or ``timeout``
    seconds have passed (None: no bound; the job itself is bounded by the parser's).

    Returns:
        Whether the job is finished (False only when ``timeout`` ran out first; the job goes on).

    Raises:
        ApiError: 503 ``shutting_down`` when the server's drain ran out first (the client gets a
            JSON answer before uvicorn's own grace period ends and it cancels the request, which
            would answer a plain-text ``500``); the worker finishes the page it is on regardless.
    """
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    deadline = None if timeout is None else loop.time() + timeout

    def finish() -> None:
        if not finished.done():
            finished.set_result(None)

    def wake(_: Job) -> None:
        loop.call_soon_threadsafe(finish)

    job.add_done_callback(wake)
    while not finished.done():
        left = _DRAIN_POLL_SECONDS if deadline is None else min(_DRAIN_POLL_SECONDS, deadline - loop.time())
        if left <= 0:
            return False
        await asyncio.wait({finished}, timeout=left)
        if not finished.done() and service.drain_expired():
            raise ApiError(503, "shutting_down", "the server shut down before the parse finished; submit it again")
    return True
