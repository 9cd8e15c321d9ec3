"""``create_app``: the FastAPI application of ``mineru-fast serve``.

Endpoints (``/v1/*`` need an API key when keys are configured):

- ``POST /v1/document/parse``: multipart ``file`` (PDF or image) plus optional ``pages``,
  ``password``, ``formats`` (``markdown,middle_json,structured_content,content_list,json,layout``; default
  ``markdown,middle_json``) and, when the server allows
  it, ``replay`` (a trace JSON file); waits for the parse and returns the result.
- ``POST /v1/jobs``: the same fields; returns ``202`` with ``job_id`` at once. With an
  ``Idempotency-Key`` header, a repeat of the request by the same API key returns the job the
  first one made (header ``Idempotent-Replayed: true``) instead of queueing another.
- ``GET /v1/jobs/{job_id}``: status and per-page progress; ``GET /v1/jobs/{job_id}/result``.
- ``GET /health``, ``GET /ready``, ``GET /metrics``, ``GET /`` (web page). ``/ready`` answers
  ``200`` once the model is loaded and the engine check passed (``service``), with the canary
  page's mode and state (``pending``, ``running``, ``passed``, ``failed``, ``off``) and its
  seconds once done; ``503`` while loading, after a failed start or canary, and while draining.
- MinerU 4's v1 document API (``/v1/health``, ``/v1/uploads``, ``/v1/parse/jobs``, ``/v1/files``,
  ``/v1/tasks``, ``/v1/file_parse``): ``mineru_api``.

Uploads are checked from their headers (format sniffed from the content, page range, password,
each page's size) before they are queued, so a broken document is answered ``422`` at once and
never takes a worker; admission counts jobs (``--workers-queue``) and the memory their pages
take decoded (``--decode-budget-mb``, shared with the chat images). Pixels are decoded only in
the workers. Before any of that, the request bodies in flight are bounded in bytes
(``--max-body-buffer-mb``, ``security.BodyBudget``; gauge
``mineru_fast_request_body_bytes_in_flight``).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, File, Form, Header, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import Gauge
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mineru_fast._version import __version__
from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.serve.admission import check_and_submit, request_id, wait_for_job
from mineru_fast.serve.chat import add_chat_routes
from mineru_fast.serve.config import ServeConfig
from mineru_fast.serve.context import RequestContextMiddleware
from mineru_fast.serve.errors import ApiError, error_body, from_exception
from mineru_fast.serve.hosts import HostCheckMiddleware
from mineru_fast.serve.jobs import AlreadySubmitted
from mineru_fast.serve.metrics import CONTENT_TYPE_LATEST
from mineru_fast.serve.mineru_api import add_mineru_routes
from mineru_fast.serve.parsing import ParseRequest, parse_formats, trace_from_json
from mineru_fast.serve.security import BodyBudget, GuardMiddleware, KeyRing, RateLimiter, load_api_keys
from mineru_fast.serve.service import Service
from mineru_fast.serve.store import JobRecord, JobStore

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


# The multipart fields of both parse endpoints.
DocumentField = Annotated[UploadFile, File(description="PDF or image; the format is sniffed from the content")]
PagesField = Annotated[str | None, Form(description="1-based page range, e.g. '1-3,5'; default every page")]
PasswordField = Annotated[str | None, Form(description="user password of an encrypted PDF")]
FormatsField = Annotated[
    str | None,
    Form(
        description="comma-separated: markdown, middle_json, structured_content, content_list, json, layout "
        "(default: markdown, middle_json)"
    ),
]
ReplayField = Annotated[UploadFile | None, File(description="replay trace JSON (servers started with --allow-replay)")]
IdempotencyKeyHeader = Annotated[
    str | None,
    Header(description="1-255 printable ASCII characters; a repeat with the same key returns the job it made"),
]
# The field's convention (IETF draft "The Idempotency-Key HTTP Header Field"; Stripe's API): an
# opaque client-chosen string, typically a UUID. The bound is this service's.
_IDEMPOTENCY_KEY = re.compile(r"[\x20-\x7e]{1,255}")


def _error_response(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error.code, error.message, request_id(request)), error.status, error.headers)


def _index_html() -> str:
    return resources.files("mineru_fast.serve").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(
    config: ServeConfig | None = None,
    *,
    parser_factory: Callable[[], DocumentParser] | None = None,
    on_load_failure: Callable[[BaseException], None] | None = None,
    job_store: JobStore | None = None,
    replica: str = "local",
) -> FastAPI:
    """Build the service's ASGI application.

    The model is loaded when the application starts (its lifespan), in a background thread:
    ``/health`` answers at once, ``/ready`` and ``/v1/*`` answer ``503`` until the parsers are
    built and the engine check passed (and the canary page parsed, with ``config.canary`` set to
    ``"before-ready"``; see ``service.Service``).

    Args:
        config: service settings; default ``ServeConfig()``.
        parser_factory: builds one ``DocumentParser``; default
            ``DocumentParser.from_pretrained(config.model, config.options)``.
        on_load_failure: called with the exception when start-up fails (the model load, the engine
            check or the canary page; see ``Service``).
        job_store: where ``POST /v1/jobs`` jobs are recorded; default one in this process's
            memory. Replicas that pass one shared store answer for each other's jobs.
        replica: this application's id in ``job_store``.

    Returns:
        The FastAPI application (``app.state.service`` is its ``Service``).

    Raises:
        ValueError: the API key file is unreadable or malformed.
    """
    config = config or ServeConfig()
    if parser_factory is None:

        def parser_factory() -> DocumentParser:
            return DocumentParser.from_pretrained(config.model, config.options)

    keyring = KeyRing(load_api_keys(config.api_key_file) if config.api_key_file else [])
    limiter = RateLimiter(config.rate_limit, config.rate_burst)
    service = Service(config, parser_factory, on_load_failure, job_store, replica)
    body_budget = BodyBudget(config.max_body_buffer_bytes, config.key_body_buffer_bytes)
    Gauge(
        "mineru_fast_request_body_bytes_in_flight",
        "Request-body bytes reserved by the requests in flight (--max-body-buffer-mb)",
        registry=service.metrics.registry,
    ).set_function(lambda: float(body_budget.used))

    def scheduler_count(name: str) -> float:
        """A counter of the fast engine's scheduler (0 before it is loaded, or on another engine)."""
        scheduler = getattr(service.parser.engine, "scheduler", None) if service.parser is not None else None
        return float(getattr(scheduler, name, 0))

    for name, help_text in (
        ("draft_tokens", "Draft tokens speculative decoding verified (--speculative)"),
        ("accepted_tokens", "Verified draft tokens that were the model's own choices"),
    ):
        Gauge(f"mineru_fast_speculative_{name}", help_text, registry=service.metrics.registry).set_function(
            functools.partial(scheduler_count, name)
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=service.load, name="model-loader", daemon=True).start()
        yield
        await run_in_threadpool(service.shutdown)

    app = FastAPI(
        title="mineru-fast",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.service = service
    # Added last = outermost: request context, then the Host/Origin check, then the guard, then the routes.
    app.add_middleware(
        GuardMiddleware,
        keyring=keyring,
        limiter=limiter,
        max_body=config.max_upload_bytes,
        body_timeout=config.body_timeout,
        min_body_rate=config.min_body_rate,
        budget=body_budget,
    )
    allowed_hosts = config.host_allow_list()
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)
    app.add_middleware(RequestContextMiddleware, metrics=service.metrics)
    _add_error_handlers(app)
    _add_routes(app, service)
    add_chat_routes(app, service)
    add_mineru_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        headers = dict(exc.headers or {})
        return _error_response(request, ApiError(exc.status_code, code, str(exc.detail), headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:5]:
            if err.get("type") == "json_invalid":  # its loc ends with the character where decoding stopped
                detail = (err.get("ctx") or {}).get("error") or err.get("msg", "invalid")
                at = [p for p in err.get("loc", ()) if isinstance(p, int)]
                problems.append(f"the body is not valid JSON: {detail}" + (f" (at character {at[-1]})" if at else ""))
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
            problems.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
        return _error_response(request, ApiError(422, "invalid_request", "; ".join(problems) or "invalid request"))


async def _read_request(
    service: Service,
    file: UploadFile,
    pages: str | None,
    password: str | None,
    formats: str | None,
    replay: UploadFile | None,
) -> ParseRequest:
    """Turn the multipart fields into a ``ParseRequest`` (everything stays in memory).

    Raises:
        ApiError: 403 ``replay_disabled``, 422 for a bad ``formats`` or replay trace.
    """
    trace = None
    if replay is not None:
        if not service.config.allow_replay:
            raise ApiError(403, "replay_disabled", "this server does not accept replay traces (--allow-replay)")
        try:
            trace = trace_from_json(await replay.read())
        except Exception as exc:
            raise from_exception(exc) from exc
    data = await file.read()
    return ParseRequest(
        data=data,
        pages=pages.strip() if pages and pages.strip() else None,
        password=password or None,
        formats=parse_formats(formats),
        trace=trace,
    )


def _idempotency_key(value: str | None) -> str | None:
    """The ``Idempotency-Key`` header's value, checked (None when absent).

    Raises:
        ApiError: 400 ``invalid_idempotency_key`` when it is not 1-255 printable ASCII characters.
    """
    if value is None or _IDEMPOTENCY_KEY.fullmatch(value):
        return value
    raise ApiError(400, "invalid_idempotency_key", "Idempotency-Key must be 1-255 printable ASCII characters")


async def _submit_once(
    service: Service, request: Request, parse_request: ParseRequest, key: str | None
) -> tuple[JobRecord, bool]:
    """Queue a retained job, unless a request with the same ``Idempotency-Key`` (``key``) made one.

    The store is asked first (so a repeat is answered while the queue is full), then again
    atomically as the job is added (so concurrent repeats, on any replica, make one job).

    Returns:
        The job's record and whether this request made it.

    Raises:
        ApiError: as ``admission.check_and_submit``; 422 ``idempotency_key_reused`` when the key's job was
            made from another request (another document, page range, formats, or password presence).
    """
    if key is None:
        job = await check_and_submit(service, request, parse_request, retain=True)
        return job.to_record(service.replica), True
    fingerprint = await run_in_threadpool(parse_request.fingerprint)  # hashes the whole upload
    stored = await run_in_threadpool(service.job_store.find, request.state.api_key, key)
    if stored is None:
        try:
            job = await check_and_submit(service, request, parse_request, retain=True, idempotency=(key, fingerprint))
        except AlreadySubmitted as exc:  # a concurrent request with this key came first
            stored = exc.record
        else:
            return job.to_record(service.replica), True
    if stored.fingerprint != fingerprint:
        raise ApiError(
            422,
            "idempotency_key_reused",
            "this Idempotency-Key was sent with another request (document, page range, formats or password); "
            "use a new key for a new request",
        )
    logger.info("job submission repeated", extra={"job_id": stored.id, "request_id": request_id(request)})
    return stored, False


async def _job_or_404(service: Service, request: Request, job_id: str, with_result: bool = False) -> JobRecord:
    """The stored job, looked up off the event loop (the store may be another process); answered
    while the model is still loading too (a replica that is starting knows the others' jobs).

    Raises:
        ApiError: 404 ``job_not_found``; 503 when the store cannot be reached.
    """
    key = request.state.api_key
    record = await run_in_threadpool(service.job_store.get, job_id, key, with_result=with_result)
    if record is None:
        raise ApiError(404, "job_not_found", "no such job (unknown id, another key's job, or its result expired)")
    return record


def _outcome_error(record: JobRecord) -> ApiError:
    """The error a finished job that has no result answers with."""
    if record.error is None:
        return ApiError(500, "internal_error", "the job ended without a result")
    return ApiError(record.error.status, record.error.code, record.error.message)


def _add_routes(app: FastAPI, service: Service) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(_index_html(), headers=_PAGE_HEADERS)

    @app.get("/health")
    async def health() -> dict:
        """Process alive (says nothing about the model)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict:
        """Model loaded and engine check passed: the model, start-up figures and the canary's mode
        and state; ``503`` otherwise (loading, a failed start or canary, draining)."""
        service.require_ready()
        return {"status": "ready", **service.ready_info(), "allow_replay": service.config.allow_replay}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/document/parse")
    async def parse_document(
        request: Request,
        file: DocumentField,
        pages: PagesField = None,
        password: PasswordField = None,
        formats: FormatsField = None,
        replay: ReplayField = None,
    ) -> JSONResponse:
        """Parse a document and wait for the result."""
        parse_request = await _read_request(service, file, pages, password, formats, replay)
        job = await check_and_submit(service, request, parse_request, retain=False)
        await wait_for_job(job, service)
        if job.status != "done" or job.result is None:
            raise job.error or ApiError(500, "internal_error", "the job ended without a result")
        # A result of many pages takes a large part of a second to encode: not on the event loop.
        return await run_in_threadpool(JSONResponse, {"request_id": request_id(request), **job.result})

    @app.post("/v1/jobs", status_code=202)
    async def submit_job(
        request: Request,
        file: DocumentField,
        pages: PagesField = None,
        password: PasswordField = None,
        formats: FormatsField = None,
        replay: ReplayField = None,
        idempotency_key: IdempotencyKeyHeader = None,
    ) -> JSONResponse:
        """Queue a document; poll ``/v1/jobs/{job_id}``, then fetch ``/v1/jobs/{job_id}/result``.
        A repeat with the same ``Idempotency-Key`` returns the job the first request made."""
        key = _idempotency_key(idempotency_key)
        parse_request = await _read_request(service, file, pages, password, formats, replay)
        record, created = await _submit_once(service, request, parse_request, key)
        position = service.jobs.queue_position(record.id) if service.jobs else None
        body = {
            **record.describe(position),
            "status_url": f"/v1/jobs/{record.id}",
            "result_url": f"/v1/jobs/{record.id}/result",
        }
        headers = {"Location": f"/v1/jobs/{record.id}"}
        if not created:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(body, 202, headers)

    @app.get("/v1/jobs/{job_id}")
    async def job_status(request: Request, job_id: str) -> dict:
        """Status and per-page progress of a job (any replica answers for any job)."""
        record = await _job_or_404(service, request, job_id)
        jobs = service.jobs
        held_here = jobs is not None and record.replica == jobs.replica
        position = jobs.queue_position(record.id) if jobs and held_here and record.status == "queued" else None
        if record.status in ("failed", "cancelled"):  # the status carries the whole outcome (the error)
            await run_in_threadpool(service.job_store.collect, record.id)
        return record.describe(position)

    @app.get("/v1/jobs/{job_id}/result")
    async def job_result(request: Request, job_id: str) -> JSONResponse:
        """The result of a finished job; ``409`` while it is queued or running."""
        record = await _job_or_404(service, request, job_id, with_result=True)
        if record.status in ("queued", "running"):
            raise ApiError(409, "job_not_finished", f"the job is {record.status}", {"Retry-After": "1"})
        await run_in_threadpool(service.job_store.collect, record.id)
        if record.status != "done" or record.result is None:
            raise _outcome_error(record)
        return await run_in_threadpool(JSONResponse, {"job_id": record.id, **record.result})  # encoded off the loop
