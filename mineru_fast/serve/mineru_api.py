"""MinerU 4's v1 document API (mineru 4.0.12 ``mineru.parser.api_server`` and ``task_api``) on the
service, so MinerU's own client (``mineru.MinerUApiParser``, ``mineru-kit parse --api-url``) and
clients written for MinerU's server parse through mineru-fast unchanged apart from the URL.

Routes (``add_mineru_routes``):

- ``GET /v1/health``: readiness and ``features`` (the sources and output formats served).
- Uploads, as MinerU's client sends a document: ``POST /v1/uploads`` (JSON: ``filename``,
  ``bytes``, ``mime_type``, ``purpose``, optional ``sha256sum``, ``expires_after``),
  ``PUT /v1/uploads/{id}/content`` (the bytes), ``POST /v1/uploads/{id}/complete`` (optional
  ``sha256sum``), ``GET /v1/uploads/{id}``, ``POST /v1/uploads/{id}/cancel``; the file made is
  ``GET /v1/files/{id}`` and ``DELETE /v1/files/{id}`` (``mineru_files.FileStore``).
- Parse jobs: ``POST /v1/parse/jobs`` (JSON: ``files`` ``[{"source", "page_range"}]``, ``tier``,
  ``ocr_mode``, ``output_formats``), ``GET /v1/parse/jobs/{job_id}``; the outputs of a finished job
  are files too: ``GET /v1/files/{file_id}/content``.
- Tasks, one request per document: ``POST /v1/tasks`` (multipart ``files``, a raw
  ``application/octet-stream`` body with ``?filename=``, or the JSON of a parse job; options in
  the query string), ``GET /v1/tasks/{task_id}``, ``GET /v1/tasks/{task_id}/result``
  (``?response_format=json`` inlines the outputs, ``zip`` answers the bundle); ``POST
  /v1/file_parse`` submits one and waits up to ``?wait_timeout=`` seconds (default 300) for it.
  A document's name (declared with an upload, sent inline or with the request) is kept and
  answered as ``shown_name`` makes it.

Every job is one of the service's jobs (``admission.check_and_submit``: the same checks, queue,
decode budget, ``Retry-After``, metrics and job store; ``GET /v1/jobs/{job_id}`` knows it too),
parsed into MinerU 4's bundle (``bundle.run_bundle``): ``markdown.md``, ``middle_json.json``,
``structured_content.json`` and the zip of the whole bundle, as ``mineru-fast parse`` writes them.
API keys, rate limits, the upload-size limit, the error format (``{"error": {"code", "message",
"request_id"}}``; MinerU's client reads ``code`` and ``message``) and the request metrics are the
service's.

What mineru-fast cannot honour is refused ``400``, never ignored: a ``tier`` other than the
server's (``flash`` and ``basic`` are not built), an ``ocr_mode`` other than the server's, the
``html`` / ``latex`` / ``docx`` outputs, ``url`` and ``local`` sources (the server fetches no URL
and reads no path a client names), webhook ``callback``\\s, more than one file per job.
Cancelling (``DELETE`` of a job or task) is answered ``405``: jobs run to completion. A
``page_range`` is MinerU's syntax (``"1-5,8,r3-r1"``, ``"all"``; ``rN`` counts from the end).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import PurePath
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from mineru_fast._version import __version__
from mineru_fast.errors import PageRangeError
from mineru_fast.inputs.documents import MAX_PAGE_RANGE_CHARS
from mineru_fast.protocol.traces import Trace, load_trace
from mineru_fast.serve.admission import check_and_submit, wait_for_job
from mineru_fast.serve.bundle import BUNDLE_OUTPUTS, BundleRequest
from mineru_fast.serve.errors import ApiError, from_exception
from mineru_fast.serve.jobs import Job
from mineru_fast.serve.mineru_files import FileStore, SourceFile, Upload
from mineru_fast.serve.parsing import ParseRequest, inspect_document
from mineru_fast.serve.store import JobRecord

if TYPE_CHECKING:
    from mineru_fast.serve.service import Service

__all__ = ["MineruDoor", "MineruJob", "MineruJobs", "add_mineru_routes", "page_spec", "needs_page_count", "shown_name"]

Tier = Literal["flash", "basic", "standard", "advanced"]
"""MinerU 4's tiers (mineru 4.0.12 ``mineru.types.Tier``); mineru-fast builds ``standard`` and ``advanced``."""
OcrMode = Literal["auto", "txt", "ocr"]
SOURCES = ("file_id", "inline")
"""The job sources served (MinerU's server also takes ``url`` and, when allowed, ``local``)."""
MAX_FILES_PER_REQUEST = 100  # MinerU's bound (api_server._MAX_FILES_PER_JOB_DEFAULT); mineru-fast takes one
_TERMINAL = frozenset({"completed", "partial", "failed", "canceled"})
_STATUS = {"queued": "queued", "running": "running", "done": "completed", "failed": "failed", "cancelled": "canceled"}
_OUTPUT_KEYS = ("markdown", "middle_json", "structured_content", "html", "latex", "docx", "zip")  # MinerU's OutputFiles
# What the outputs are named in MinerU's server (api_server._run_job) and answered as here.
_OUTPUT_SUFFIXES = {"markdown": ".md", "middle_json": ".middle.json", "structured_content": ".structured_content.json"}
_OUTPUT_TYPES = {"markdown": "text/markdown; charset=utf-8", "zip": "application/zip"}
_SEGMENT = re.compile(r"(r?[1-9][0-9]*)(?:\s*-\s*(r?[1-9][0-9]*))?")  # MinerU's page range part
# Characters a file name must not carry into an answer: C0 and C1 controls, bidirectional formatting.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_MAX_NAME_CHARS = 200  # a name with the longest output suffix (.structured_content.json) stays within 255


# -- request bodies (MinerU's models: unknown fields are refused) ------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


_Body = TypeVar("_Body", bound=_Strict)


class ExpiresAfter(_Strict):
    """How long an upload's records live (MinerU's bounds; capped here at ``--result-ttl``)."""

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(default=3600, ge=3600, le=2592000)


class CreateUploadBody(_Strict):
    """``POST /v1/uploads``."""

    filename: str = Field(min_length=1, max_length=1024)
    size: int = Field(alias="bytes", gt=0)
    mime_type: str = Field(min_length=1, max_length=255)
    purpose: Literal["parse", "input_image"] = "parse"
    sha256sum: str | None = Field(default=None, pattern=r"^[a-f0-9]{64}$")
    expires_after: ExpiresAfter | None = None


class CompleteUploadBody(_Strict):
    """``POST /v1/uploads/{id}/complete``."""

    sha256sum: str | None = Field(default=None, pattern=r"^[a-f0-9]{64}$")


class FileIdSource(_Strict):
    """A completed upload."""

    type: Literal["file_id"] = "file_id"
    file_id: str = Field(min_length=1, max_length=255)


class InlineSource(_Strict):
    """The document in the request, base64."""

    type: Literal["inline"] = "inline"
    name: str = Field(min_length=1, max_length=1024)
    data: str = Field(min_length=1)


class UrlSource(_Strict):
    """A URL for the server to fetch (refused here)."""

    type: Literal["url"] = "url"
    url: str


class LocalSource(_Strict):
    """A path on the server (refused here)."""

    type: Literal["local"] = "local"
    path: str


class JobFile(_Strict):
    """One file of a parse job."""

    source: Annotated[FileIdSource | InlineSource | UrlSource | LocalSource, Field(discriminator="type")]
    page_range: str | None = None


class Callback(_Strict):
    """A webhook (refused here)."""

    url: str
    secret: str | None = None


class CreateJobBody(_Strict):
    """``POST /v1/parse/jobs`` (and the JSON form of ``/v1/tasks`` and ``/v1/file_parse``)."""

    files: list[JobFile] = Field(min_length=1, max_length=MAX_FILES_PER_REQUEST)
    tier: Tier | None = None
    ocr_mode: OcrMode | None = None
    output_formats: list[str] = Field(default_factory=lambda: ["markdown"], max_length=16)
    callback: Callback | None = None


class TaskOptions(_Strict):
    """The query-string options of ``/v1/tasks`` and ``/v1/file_parse`` with an uploaded body."""

    tier: Tier | None = None
    ocr_mode: OcrMode | None = None
    page_range: str = ""
    output_formats: list[str] = Field(default_factory=lambda: ["markdown"], max_length=16)
    filename: str | None = Field(default=None, min_length=1, max_length=1024)
    sha256sum: str | None = Field(default=None, pattern=r"^[a-f0-9]{64}$")


# -- jobs ----------------------------------------------------------------------------------------


@dataclass
class MineruJob:
    """What a MinerU job asked for, beside the service's record of it.

    Attributes:
        id: the service's job id (also MinerU's ``job_id`` / ``task_id``).
        name: the document's file name, as sent.
        file_id: the source file's id (None for an inline or uploaded-with-the-task document).
        page_range: the page range as sent, stripped ("" = every page).
        tier: the tier that runs it (the server's).
        output_formats: the outputs asked for, in order, each once.
        finished: ``time.monotonic()`` when the job ended, None before.
    """

    id: str
    name: str
    file_id: str | None
    page_range: str
    tier: str
    output_formats: list[str]
    finished: float | None = None


class MineruJobs:
    """The ``MineruJob`` of each job this process queued, kept until ``keep`` seconds after it
    ended (the job store forgets it then too).

    Args:
        keep: seconds (the service's ``result_ttl``).
    """

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self._jobs: dict[str, MineruJob] = {}

    def add(self, job: Job, described: MineruJob) -> None:
        """Keep ``described`` for ``job`` (from the event loop)."""
        now = time.monotonic()
        for job_id, held in list(self._jobs.items()):
            if held.finished is not None and now - held.finished > self.keep:
                del self._jobs[job_id]
        self._jobs[job.id] = described

        def ended(_: Job) -> None:
            described.finished = time.monotonic()

        job.add_done_callback(ended)

    def get(self, job_id: str) -> MineruJob | None:
        """The job's description, None when this process did not queue it (or forgot it)."""
        return self._jobs.get(job_id)


# -- page ranges -----------------------------------------------------------------------------------


def page_spec(text: str | None, page_count: int | None = None) -> str | None:
    """MinerU's page range (docvortex ``page_range``: 1-based inclusive parts such as
    ``"1-5,8,r3-r1"``, ``rN`` the N-th page from the end, ``"all"`` or blank for every page) as
    mineru-fast's (``inputs.parse_page_range``; parts past the document are dropped there, as
    MinerU drops them).

    Args:
        text: the range as sent.
        page_count: the document's pages; needed only when a part counts from the end (see
            ``needs_page_count``).

    Returns:
        The range for ``ParseRequest.pages``; None for every page.

    Raises:
        PageRangeError: malformed text, a reversed part, more than ``MAX_PAGE_RANGE_CHARS``
            characters, or no page of the document selected.
        ValueError: a part counts from the end and ``page_count`` is None.
    """
    segments = _segments(text)
    if segments is None:
        return None
    parts = []
    for start, end in segments:
        if start < 0 or end < 0:
            if page_count is None:
                raise ValueError("a page range counting from the end needs the page count")
            start, end = (v if v > 0 else page_count + v + 1 for v in (start, end))
            if start > end:
                raise PageRangeError(f"page range {_quoted(text)} is reversed on a {page_count}-page document")
            start = max(1, start)
            if end < 1:
                continue
        parts.append(str(start) if start == end else f"{start}-{end}")
    if not parts:
        raise PageRangeError(f"page range {_quoted(text)} selects no page of the document")
    return ",".join(parts)


def needs_page_count(text: str | None) -> bool:
    """Whether a MinerU page range counts from the end (``rN``).

    Raises:
        PageRangeError: as ``page_spec``.
    """
    return any(start < 0 or end < 0 for start, end in _segments(text) or [])


def _segments(text: str | None) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each part, ``-N`` for ``rN``; None for every page."""
    value = (text or "").strip()
    if not value or value == "all":
        return None
    if len(value) > MAX_PAGE_RANGE_CHARS:
        raise PageRangeError(f"the page range is {len(value):,} characters long; the limit is {MAX_PAGE_RANGE_CHARS:,}")
    segments = []
    for part in value.split(","):
        match = _SEGMENT.fullmatch(part.strip())
        if match is None:
            raise PageRangeError(f"bad page range part {_quoted(part)}: expected e.g. '1-5,8,r3-r1' or 'all'")
        start = _endpoint(match[1])
        end = _endpoint(match[2]) if match[2] else start
        if (start > 0) == (end > 0) and start > end:
            raise PageRangeError(f"page range part {_quoted(part)} is reversed")
        segments.append((start, end))
    return segments


def _endpoint(token: str) -> int:
    return -int(token[1:]) if token.startswith("r") else int(token)


def _quoted(text: str | None, limit: int = 24) -> str:
    text = text or ""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _compact(numbers: list[int]) -> str:
    """1-based page numbers as MinerU writes a parsed range: ``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    parts: list[list[int]] = []
    for number in sorted(set(numbers)):
        if parts and number == parts[-1][1] + 1:
            parts[-1][1] = number
        else:
            parts.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


# -- the routes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Document:
    """A document to queue: its bytes, name and source file id."""

    data: bytes
    name: str
    file_id: str | None = None


@dataclass(frozen=True)
class _Asked:
    """A job's options, checked: the tier that runs it and the outputs, in order, each once."""

    tier: str
    outputs: list[str]


class MineruDoor:
    """What MinerU's routes share: the service, the uploads (``FileStore``), the ``MineruJob`` of
    each job queued here, the replay traces; the checks, submission and answers of the routes.

    Uploads live in this process: at most one full-size upload (``--max-upload-mb``) per job the
    server holds at once (``--workers`` plus ``--workers-queue``), each for ``--result-ttl``
    seconds at most; one API key holds a quarter of that (at least one full-size upload) and an
    eighth of the records, and a declaration whose bytes do not come within a minute expires.
    With ``--replay DIR`` a document whose file name's stem names a trace ``DIR/<stem>.json`` is
    replayed (tests, benchmarks).

    Args:
        service: the running service.
    """

    def __init__(self, service: Service) -> None:
        config = self.config = service.config
        self.service = service
        store_bytes = config.max_upload_bytes * (config.queue_size + config.workers)
        key_bytes = max(config.max_upload_bytes, store_bytes // 4)
        self.files = FileStore(store_bytes, config.result_ttl, key_bytes=min(key_bytes, store_bytes))
        self.jobs = MineruJobs(config.result_ttl)
        replay = config.replay_dir
        self.traces = {path.stem: path for path in sorted(replay.glob("*.json"))} if replay else {}

    @property
    def access_level(self) -> str:
        """MinerU's ``access_level``: ``registered`` when the server takes API keys."""
        return "registered" if self.config.api_key_file is not None else "anonymous"

    # -- checks and submission ---------------------------------------------------------------------
    def checked(self, tier: str | None, ocr_mode: str | None, formats: list[str], callback: object) -> _Asked:
        """The options a request may have here, or a ``400`` naming what is not served."""
        parser = self.service.require_parser()
        if callback is not None:
            raise ApiError(400, "callback_unsupported", "webhook callbacks are not served; poll the job instead")
        if tier is not None and tier != parser.tier:
            if tier in ("flash", "basic"):
                why = f"tier {tier!r} is not built (it needs models other than the MinerU2.5 VLM)"
            else:
                why = f"tier {tier!r} is served by a server started with --tier {tier}"
            raise ApiError(400, "tier_unavailable", f"{why}; this server runs tier {parser.tier!r}")
        if ocr_mode is not None and ocr_mode != parser.options.ocr_mode:
            raise ApiError(
                400,
                "ocr_mode_unavailable",
                f"this server parses every document with ocr_mode {parser.options.ocr_mode!r} (serve --ocr-mode); "
                f"{ocr_mode!r} is not served",
            )
        unknown = [f for f in formats if f not in BUNDLE_OUTPUTS]
        if unknown:
            raise ApiError(
                400,
                "unsupported_output_format",
                f"output format(s) {', '.join(map(repr, unknown))} are not served; choose from "
                f"{', '.join(BUNDLE_OUTPUTS)} (DocVortex renders html, latex and docx from the zip's middle_json.json)",
            )
        if not formats:
            raise ApiError(
                400, "unsupported_output_format", f"output_formats is empty; choose from {', '.join(BUNDLE_OUTPUTS)}"
            )
        return _Asked(parser.tier, list(dict.fromkeys(formats)))

    def source_document(self, request: Request, entry: JobFile) -> _Document:
        """The document a job's file names: a source file of the request's key, or inline bytes.

        Raises:
            ApiError: 404 ``file_not_found``; 400 ``invalid_request`` for data that is not
                base64, ``unsupported_source`` for a ``url`` or ``local`` source.
        """
        source = entry.source
        if isinstance(source, FileIdSource):
            held = self.files.get_file(request.state.api_key, source.file_id)
            return _Document(held.data, held.filename, held.id)
        if isinstance(source, InlineSource):
            try:
                data = base64.b64decode(source.data, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "invalid_request", "files.0.source.data is not valid base64") from None
            return _Document(data, shown_name(source.name))
        kind = "fetches no URL" if isinstance(source, UrlSource) else "reads no path a client names"
        raise ApiError(
            400,
            "unsupported_source",
            f"{source.type!r} sources are not served: the server {kind}; upload the file (POST /v1/uploads) "
            "or send it inline",
        )

    async def replay_trace(self, name: str) -> Trace | None:
        """The ``--replay`` trace of a document named ``name`` (by its stem), None without one.

        Raises:
            ApiError: 422 ``bad_replay_trace`` for a trace file that does not read.
        """
        path = self.traces.get(PurePath(name).stem)
        if path is None:
            return None
        try:
            return await run_in_threadpool(load_trace, path)
        except Exception as exc:
            raise from_exception(exc) from exc

    async def submit(self, request: Request, document: _Document, page_range: str | None, asked: _Asked) -> Job:
        """Queue a document as one of the service's jobs, parsed into MinerU 4's bundle.

        Raises:
            ApiError: 400 ``empty_file``; as ``admission.check_and_submit`` (422 for a broken
                document or a bad page range, 429 when full, 503 when not ready).
        """
        if not document.data:
            raise ApiError(400, "empty_file", "the file is empty")
        try:
            count = None
            if needs_page_count(page_range):
                probe = ParseRequest(data=document.data)
                info = await run_in_threadpool(inspect_document, probe, self.config.options, sys.maxsize)
                count = info.page_count
            pages = page_spec(page_range, count)
        except Exception as exc:
            raise from_exception(exc) from exc
        parse_request = BundleRequest(
            data=document.data,
            pages=pages,
            formats=frozenset(),
            trace=await self.replay_trace(document.name),
            name=PurePath(document.name).stem or "document",
            outputs=frozenset(asked.outputs),
        )
        job = await check_and_submit(self.service, request, parse_request, retain=True)
        described = MineruJob(
            job.id, document.name, document.file_id, (page_range or "").strip(), asked.tier, asked.outputs
        )
        self.jobs.add(job, described)
        return job

    # -- answers -----------------------------------------------------------------------------------
    async def lookup(self, request: Request, job_id: str) -> tuple[JobRecord, MineruJob]:
        """The job's record, with its result (its outputs' sizes are part of the status), and description."""
        described = self.jobs.get(job_id)
        record = await run_in_threadpool(self.service.job_store.get, job_id, request.state.api_key, with_result=True)
        if record is None or described is None:
            raise ApiError(404, "job_not_found", "no such job (unknown id, another key's, or its result expired)")
        return record, described

    def job_body(self, record: JobRecord, described: MineruJob, base: str = "/v1/parse/jobs") -> dict:
        """MinerU's ``JobAsyncResponse`` of a job (mineru 4.0.12 ``api_server``)."""
        status, entry = _file_entry(record, described, self.service.info.get("model"))
        completed, failed = entry["status"] == "completed", entry["status"] == "failed"
        link = f"{base}/{record.id}"
        return {
            "job_id": record.id,
            "status": status,
            "created_at": _iso(record.created_at),
            "started_at": _iso(record.started_at),
            "finished_at": _iso(record.finished_at),
            "tier": described.tier,
            "output_formats": described.output_formats,
            "access_level": self.access_level,
            "progress": {"completed": int(completed), "failed": int(failed), "total": 1},
            "files": [entry],
            "links": {"self": link, "cancel": link},
        }

    def task_body(self, record: JobRecord, described: MineruJob) -> dict:
        """A job as ``/v1/tasks`` answers it: ``task_id`` and its URLs (``task_api.task_payload``)."""
        body = self.job_body(record, described, "/v1/tasks")
        task_id = body.pop("job_id")
        link = f"/v1/tasks/{task_id}"
        return {"task_id": task_id, **body, "status_url": link, "result_url": f"{link}/result"}

    async def collect(self, record: JobRecord) -> None:
        """Record that the job's outcome went to a client (what a drain waits for)."""
        await run_in_threadpool(self.service.job_store.collect, record.id)

    async def task_result(self, record: JobRecord, described: MineruJob, response_format: str) -> Response:
        """``GET /v1/tasks/{id}/result``'s answer (``task_api.build_task_result``): ``202`` with the
        status while it runs, ``409`` with it once failed, else the outputs inline or the zip."""
        body = self.task_body(record, described)
        if body["status"] not in _TERMINAL:
            return JSONResponse(body, 202, {"Retry-After": "1"})
        await self.collect(record)
        if body["status"] in ("failed", "canceled"):
            return JSONResponse(body, 409)
        bundle = (record.result or {}).get("bundle", {})
        if response_format == "zip":
            if "zip" not in bundle:
                raise ApiError(
                    400, "unsupported_output_format", "ask for zip in output_formats when submitting the task"
                )
            headers = {
                "Content-Disposition": f'attachment; filename="{record.id}.zip"',
                "X-MinerU-Task-Id": record.id,
                "X-MinerU-Task-Status": body["status"],
            }
            archive = await run_in_threadpool(base64.b64decode, bundle["zip"]["base64"])
            return Response(archive, media_type="application/zip", headers=headers)

        def inline() -> JSONResponse:
            content: dict[str, Any] = {}
            for fmt in described.output_formats:
                if fmt in ("middle_json", "structured_content"):
                    content[fmt] = json.loads(bundle[fmt]["content"])
                elif fmt == "markdown":
                    content[fmt] = bundle[fmt]["content"]
            body["files"][0]["content"] = content
            return JSONResponse(body)

        # The outputs of many pages take a large part of a second to decode and encode: not on the event loop.
        return await run_in_threadpool(inline)

    async def output(self, request: Request, file_id: str) -> tuple[JobRecord, MineruJob, str] | None:
        """The finished job and output a parse output's id names; None for another kind of id."""
        fmt, dot, job_id = file_id.removeprefix("file-").partition(".")
        if not (file_id.startswith("file-") and dot and fmt in BUNDLE_OUTPUTS):
            return None
        try:
            record, described = await self.lookup(request, job_id)
        except ApiError:
            record = None
        if record is None or fmt not in ((record.result or {}).get("bundle") or {}):
            raise ApiError(
                404, "file_not_found", "no such file (unknown id, another key's, or its job's result expired)"
            )
        return record, described, fmt

    def output_object(self, record: JobRecord, described: MineruJob, fmt: str) -> dict:
        """MinerU's ``FileObjectModel`` of a job's output ``fmt``."""
        finished = int(record.finished_at or time.time())
        return {
            "id": _output_id(fmt, record.id),
            "object": "file",
            "bytes": record.result["bundle"][fmt]["bytes"] if record.result else 0,
            "created_at": finished,
            "expires_at": finished + int(self.config.result_ttl),
            "filename": described.name + _OUTPUT_SUFFIXES.get(fmt, ".zip"),
            "purpose": "parse_output",
            "sha256sum": None,
        }

    async def task_submission(self, request: Request, sync: bool, force_zip: bool) -> Job:
        """Read a ``/v1/tasks`` or ``/v1/file_parse`` request (JSON, multipart or raw) and queue it."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        params = {
            k: v for k, v in request.query_params.items() if not (sync and k in ("response_format", "wait_timeout"))
        }
        if media_type == "application/json":
            if params:
                raise ApiError(400, "invalid_request", "a JSON request carries its options in the body, not the query")
            body = _validated(CreateJobBody, await request.body())
            formats = body.output_formats + (["zip"] if force_zip else [])
            asked = self.checked(body.tier, body.ocr_mode, formats, body.callback)
            _one_file(len(body.files))
            return await self.submit(
                request, self.source_document(request, body.files[0]), body.files[0].page_range, asked
            )
        if "output_formats" in params:
            params["output_formats"] = request.query_params.getlist("output_formats")  # type: ignore[assignment]
        try:
            options = TaskOptions.model_validate(params)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        asked = self.checked(
            options.tier, options.ocr_mode, options.output_formats + (["zip"] if force_zip else []), None
        )
        if media_type == "application/octet-stream":
            if options.filename is None:
                raise ApiError(400, "invalid_request", "a raw upload names its file: ?filename=NAME")
            if request.headers.get("content-length") is None:
                raise ApiError(411, "length_required", "a raw upload needs a Content-Length header")
            data = await request.body()
            if options.sha256sum is not None and await run_in_threadpool(_sha256, data) != options.sha256sum:
                raise ApiError(400, "file_hash_mismatch", "the SHA-256 of the body differs from sha256sum")
            document = _Document(data, shown_name(options.filename))
            return await self.submit(request, document, options.page_range, asked)
        if media_type == "multipart/form-data":
            if options.filename is not None or options.sha256sum is not None:
                raise ApiError(400, "invalid_request", "filename and sha256sum go with a raw upload only")
            async with request.form(max_files=MAX_FILES_PER_REQUEST, max_fields=0) as form:
                uploads = form.getlist("files")
                if not uploads or any(key != "files" for key in form):
                    raise ApiError(400, "invalid_request", "send the document as the multipart field 'files'")
                _one_file(len(uploads))
                (upload,) = uploads
                if not isinstance(upload, UploadFile) or not upload.filename:
                    raise ApiError(400, "invalid_request", "the 'files' field must be a named file")
                document = _Document(await upload.read(), shown_name(upload.filename))
            return await self.submit(request, document, options.page_range, asked)
        raise ApiError(
            415, "unsupported_media_type", "send application/json, multipart/form-data or application/octet-stream"
        )


def _one_file(count: int) -> None:
    """Raises ``400 too_many_files`` unless a request holds one file."""
    if count != 1:
        raise ApiError(
            400, "too_many_files", f"{count} files in one request; this server parses one file per job (send one each)"
        )


def shown_name(name: str) -> str:
    """A file name a client sent, as answers show it (and as a client may save its outputs): its
    last path part (after the last ``/`` or ``\\``), each control or bidirectional-formatting
    character replaced by U+FFFD, at most ``_MAX_NAME_CHARS`` characters (the end cut to ``…``
    before a suffix of at most 16 characters, which is kept); ``document`` for a name of nothing
    but dots and spaces. Any other name is shown as sent."""
    shown = _UNSHOWN.sub("\ufffd", re.split(r"[/\\]", name)[-1])
    if not shown.strip(" ."):
        return "document"
    if len(shown) > _MAX_NAME_CHARS:
        suffix = PurePath(shown).suffix
        suffix = suffix if len(suffix) <= 16 else ""
        shown = shown[: _MAX_NAME_CHARS - 1 - len(suffix)] + "…" + suffix
    return shown


def _not_cancellable() -> ApiError:
    return ApiError(
        405, "cancel_unsupported", "jobs run to completion here; cancelling is not served", {"Allow": "GET"}
    )


def add_mineru_routes(app: FastAPI, service: Service) -> None:
    """Register MinerU's v1 document API (see the module's text) on the service's application;
    its uploads are ``app.state.mineru_files`` (see ``MineruDoor``)."""
    door = MineruDoor(service)
    app.state.mineru_files = door.files
    registry = service.metrics.registry
    Gauge(
        "mineru_fast_upload_bytes_held", "Bytes the v1 upload store holds (sent uploads, files)", registry=registry
    ).set_function(lambda: float(door.files.held_bytes()))
    Gauge("mineru_fast_upload_records", "Uploads and files the v1 upload store keeps", registry=registry).set_function(
        lambda: float(door.files.records())
    )

    # -- health --------------------------------------------------------------------------------------
    @app.get("/v1/health")
    async def mineru_health() -> dict:
        """Ready, and what is served (MinerU's client reads ``features.sources``)."""
        service.require_ready()
        features = {"webhook": False, "output_formats": list(BUNDLE_OUTPUTS), "sources": list(SOURCES)}
        return {"status": "ok", "version": __version__, "features": features}

    # -- uploads and files -----------------------------------------------------------------------------
    @app.post("/v1/uploads")
    async def create_upload(request: Request, body: CreateUploadBody) -> dict:
        """Declare an upload; answers where to ``PUT`` its bytes (or the file, for bytes held already)."""
        if body.size > door.config.max_upload_bytes:
            raise ApiError(
                413,
                "payload_too_large",
                f"the upload is larger than this server's limit of {door.config.max_upload_mb:g} MiB",
            )
        lifetime = body.expires_after.seconds if body.expires_after else None
        upload = door.files.create_upload(
            request.state.api_key,
            shown_name(body.filename),
            body.size,
            body.mime_type,
            body.purpose,
            body.sha256sum,
            lifetime,
        )
        answer = _upload_body(upload)
        if upload.status == "pending":
            answer["upload_url"] = f"{str(request.base_url).rstrip('/')}/v1/uploads/{upload.id}/content"
            answer["upload_method"] = "PUT"
            answer["upload_headers"] = {"Content-Type": upload.mime_type}
        return answer

    @app.get("/v1/uploads/{upload_id}")
    async def get_upload(request: Request, upload_id: str) -> dict:
        """An upload's state."""
        return _upload_body(door.files.get_upload(request.state.api_key, upload_id))

    @app.put("/v1/uploads/{upload_id}/content")
    async def put_upload_content(request: Request, upload_id: str) -> Response:
        """The bytes of a declared upload: a ``Content-Length`` other than the declared size is
        refused before the body is read, a body without one is read no further than that size."""
        upload = door.files.get_upload(request.state.api_key, upload_id)  # 404 before the body is read
        door.files.put_content(request.state.api_key, upload_id, await _body_of_size(request, upload.size))
        return Response(status_code=200)

    @app.post("/v1/uploads/{upload_id}/complete")
    async def complete_upload(request: Request, upload_id: str) -> dict:
        """Make the upload's bytes a file (optional JSON body ``{"sha256sum"}``)."""
        raw = await request.body()
        body = _validated(CompleteUploadBody, raw if raw.strip() else b"{}")
        upload = door.files.get_upload(request.state.api_key, upload_id)
        digest = await run_in_threadpool(_sha256, upload.data or b"")
        return _upload_body(door.files.complete(request.state.api_key, upload_id, digest, body.sha256sum))

    @app.post("/v1/uploads/{upload_id}/cancel")
    async def cancel_upload(request: Request, upload_id: str) -> dict:
        """Cancel a pending upload."""
        return _upload_body(door.files.cancel(request.state.api_key, upload_id))

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> dict:
        """A source file or a parse output."""
        found = await door.output(request, file_id)
        if found is not None:
            return door.output_object(*found)
        return _file_body(door.files.get_file(request.state.api_key, file_id))

    @app.get("/v1/files/{file_id}/content")
    async def get_file_content(request: Request, file_id: str) -> Response:
        """A parse output's bytes (source files are not handed back, as on MinerU's server)."""
        found = await door.output(request, file_id)
        if found is None:
            door.files.get_file(request.state.api_key, file_id)  # 404 for what does not exist
            raise ApiError(403, "source_not_downloadable", "source files cannot be downloaded; parse outputs can")
        record, _, fmt = found
        await door.collect(record)
        held = record.result["bundle"][fmt] if record.result else {}
        data = base64.b64decode(held["base64"]) if fmt == "zip" else held["content"].encode("utf-8")
        return Response(data, media_type=_OUTPUT_TYPES.get(fmt, "application/json"))

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> dict:
        """Forget a source file (a parse output goes when its job's result expires)."""
        if await door.output(request, file_id) is not None:
            raise ApiError(
                405, "output_not_deletable", "parse outputs expire with their job's result", {"Allow": "GET"}
            )
        door.files.delete_file(request.state.api_key, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- parse jobs ----------------------------------------------------------------------------------
    @app.post("/v1/parse/jobs", status_code=202)
    async def create_parse_job(request: Request, body: CreateJobBody) -> JSONResponse:
        """Queue a parse job; poll ``GET /v1/parse/jobs/{job_id}``, then download its outputs."""
        asked = door.checked(body.tier, body.ocr_mode, body.output_formats, body.callback)
        _one_file(len(body.files))
        job = await door.submit(request, door.source_document(request, body.files[0]), body.files[0].page_range, asked)
        return JSONResponse(door.job_body(*await door.lookup(request, job.id)), 202)

    @app.get("/v1/parse/jobs/{job_id}")
    async def get_parse_job(request: Request, job_id: str) -> dict:
        """A job's status, and its outputs' ids once completed."""
        record, described = await door.lookup(request, job_id)
        body = door.job_body(record, described)
        if body["status"] in ("failed", "canceled"):  # the status carries the whole outcome
            await door.collect(record)
        return body

    @app.delete("/v1/parse/jobs/{job_id}")
    async def cancel_parse_job(job_id: str) -> None:
        """Not served: jobs run to completion."""
        raise _not_cancellable()

    # -- tasks ---------------------------------------------------------------------------------------
    @app.post("/v1/tasks", status_code=202)
    async def create_task(request: Request) -> JSONResponse:
        """Queue one document (JSON, multipart ``files`` or a raw body); answers its ``task_id``."""
        job = await door.task_submission(request, sync=False, force_zip=False)
        return JSONResponse(door.task_body(*await door.lookup(request, job.id)), 202)

    @app.get("/v1/tasks/{task_id}")
    async def get_task(request: Request, task_id: str) -> dict:
        """A task's status."""
        return door.task_body(*await door.lookup(request, task_id))

    @app.delete("/v1/tasks/{task_id}")
    async def cancel_task(task_id: str) -> None:
        """Not served: tasks run to completion."""
        raise _not_cancellable()

    @app.get("/v1/tasks/{task_id}/result", response_model=None)
    async def get_task_result(
        request: Request, task_id: str, response_format: Literal["json", "zip"] = "json"
    ) -> Response:
        """The outputs inline (``json``) or the bundle (``zip``); ``202`` while it runs."""
        record, described = await door.lookup(request, task_id)
        return await door.task_result(record, described, response_format)

    @app.post("/v1/file_parse", response_model=None)
    async def file_parse(
        request: Request,
        response_format: Literal["json", "zip"] = "json",
        wait_timeout: Annotated[int, Query(ge=1, le=3600)] = 300,
    ) -> Response:
        """Submit one document and wait up to ``wait_timeout`` s for its outputs (then ``202``:
        poll ``/v1/tasks/{task_id}/result``)."""
        job = await door.task_submission(request, sync=True, force_zip=response_format == "zip")
        await wait_for_job(job, service, wait_timeout)
        record, described = await door.lookup(request, job.id)
        return await door.task_result(record, described, response_format)


def _file_entry(record: JobRecord, described: MineruJob, model: str | None) -> tuple[str, dict]:
    """MinerU's job status and its one ``JobFileResult`` (``api_server._run_job``'s fields)."""
    status = _STATUS[record.status]
    entry: dict[str, Any] = {
        "file_id": described.file_id,
        "name": described.name,
        "page_range": described.page_range,
        "status": status if status in ("queued", "running", "completed") else "failed",
        "parse": None,
        "output_files": None,
        "error": None,
    }
    result = record.result
    if record.status == "done" and result is not None and result.get("status") == "failure":
        status = entry["status"] = "failed"  # every page failed: MinerU fails the file
        problems = result.get("errors") or [e for page in result.get("pages", []) for e in page.get("errors", [])]
        first = problems[0] if problems else {"code": "parse_failed", "message": "no page of the document parsed"}
        entry["error"] = {
            "type": "api_error",
            "code": first.get("code"),
            "message": first.get("message"),
            "param": None,
        }
    elif status == "completed":
        outputs = dict.fromkeys(_OUTPUT_KEYS)
        for fmt, held in ((result or {}).get("bundle") or {}).items():
            outputs[fmt] = {"file_id": _output_id(fmt, record.id), "bytes": held["bytes"]}
        if result is not None:
            entry["page_range"] = _compact([page["page_idx"] + 1 for page in result["pages"]])
        entry["output_files"] = outputs if result is not None else None
    elif record.error is not None:
        kind = "invalid_request_error" if record.error.status < 500 else "api_error"
        entry["error"] = {"type": kind, "code": record.error.code, "message": record.error.message, "param": None}
    if record.started_at is not None and record.finished_at is not None and status in ("completed", "failed"):
        entry["parse"] = {
            "model_used": model,
            "duration_ms": int((record.finished_at - record.started_at) * 1000),
            "parser_version": f"mineru-fast {__version__}",
        }
    return status, entry


def _output_id(fmt: str, job_id: str) -> str:
    """The file id of a job's output: the job's id and the output (job ids hold no ``.``)."""
    return f"file-{fmt}.{job_id}"


def _upload_body(upload: Upload) -> dict:
    """MinerU's ``UploadResponse``."""
    return {
        "id": upload.id,
        "object": "upload",
        "bytes": upload.size,
        "created_at": upload.created_at,
        "expires_at": upload.expires_at,
        "filename": upload.filename,
        "purpose": upload.purpose,
        "mime_type": upload.mime_type,
        "sha256sum": upload.sha256,
        "status": upload.status,
        "upload_url": None,
        "upload_method": None,
        "upload_headers": None,
        "file": _file_body(upload.file) if upload.file is not None else None,
    }


def _file_body(source: SourceFile) -> dict:
    """MinerU's ``FileObjectModel`` of a source file."""
    return {
        "id": source.id,
        "object": "file",
        "bytes": len(source.data),
        "created_at": source.created_at,
        "expires_at": source.expires_at,
        "filename": source.filename,
        "purpose": "parse",
        "sha256sum": source.sha256,
    }


def _iso(seconds: float | None) -> str | None:
    """Unix time as MinerU writes it (ISO 8601, UTC, whole seconds)."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _body_of_size(request: Request, size: int) -> bytes:
    """A request's body, which must be ``size`` bytes.

    Raises:
        ApiError: 400 ``upload_size_mismatch`` when its ``Content-Length`` says another size
            (before any byte is read) or, without one, once it runs past ``size`` bytes or ends
            short.
    """

    def mismatch(sent: str) -> ApiError:
        return ApiError(400, "upload_size_mismatch", f"the upload declared {size} bytes; {sent} were sent")

    declared = request.headers.get("content-length")
    if declared is not None and declared.strip() != str(size):
        raise mismatch(declared.strip())
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > size:
            raise mismatch(f"more than {size}")
        chunks.append(chunk)
    if received != size:
        raise mismatch(str(received))
    return b"".join(chunks)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _validated(model: type[_Body], raw: bytes) -> _Body:
    """A request body read as JSON into ``model``.

    Raises:
        ApiError: 422 ``invalid_request`` for text that is not JSON.
        RequestValidationError: JSON outside the model (answered as the service answers those).
    """
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
