"""The HTTP clients: retry and error logic over a mock transport, the upload re-encoding, then
``Client`` / ``AsyncClient`` against the real ``mineru-fast serve`` (tiny model, 127.0.0.1),
killed and restarted under a polling client, and flooded past its queue."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from samples import image_bytes, pdf_bytes, text_page
from serve_helpers import REPO, Server, free_port, wait_ready

from mineru_fast.client import AsyncClient, Client, RetryPolicy, _Retries, error_from_response
from mineru_fast.errors import (
    AuthenticationFailed,
    DocumentNotFound,
    DocumentRejected,
    InputError,
    JobNotFound,
    RateLimited,
    ServiceError,
    ServiceUnavailable,
    ServiceUnreachable,
)
from mineru_fast.inputs.documents import open_document
from mineru_fast.inputs.upload import UploadPolicy, prepare_upload

KEY = "client-test-secret-0042"
FAST = RetryPolicy(backoff=0.001, max_backoff=0.002)
# Random weights never emit a valid layout: a page is its bounded layout pass and nothing else.
BOUNDS = "layout=8,text=4,table=4,equation=4"


def error(status: int, code: str, retry_after: str | None = None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"error": {"code": code, "message": f"{code} happened", "request_id": "r1"}}
    return httpx.Response(status, json=body, headers=headers)


# -- retry and error logic, no server ------------------------------------------------------------


def test_retry_waits_honour_retry_after_and_bounds():
    retries = _Retries(RetryPolicy(attempts=4, backoff=1.0, max_backoff=4.0, budget=20.0))
    assert retries.after_response(error(429, "queue_full", "3")) == 3.0  # exactly what the service asked
    assert 1.0 <= retries.after_error() <= 2.0  # 2 s backoff (second retry) less up to half of it
    date = "Wed, 21 Oct 2015 07:28:00 GMT"  # an HTTP date in the past: retry at once
    assert retries.after_response(error(503, "not_ready", date)) == 0.0
    assert retries.after_response(error(503, "not_ready", "1")) is None  # 4 tries made
    assert _Retries(RetryPolicy(budget=10)).after_response(error(429, "queue_full", "11")) is None
    assert _Retries(RetryPolicy()).after_response(error(503, "model_load_failed")) is None
    assert _Retries(RetryPolicy()).after_response(error(500, "internal_error")) is None


def test_errors_are_typed_from_the_service_body():
    rejected = error_from_response(error(422, "password_required"))
    assert isinstance(rejected, DocumentRejected) and isinstance(rejected, InputError)
    assert (rejected.status, rejected.code, rejected.message, rejected.request_id) == (
        422,
        "password_required",
        "password_required happened",
        "r1",
    )
    assert str(rejected) == "password_required happened"  # the message alone, as the README says
    assert type(error_from_response(error(401, "invalid_api_key"))) is AuthenticationFailed
    assert type(error_from_response(error(404, "job_not_found"))) is JobNotFound
    assert type(error_from_response(error(404, "not_found"))) is ServiceError  # a route, not a job
    assert error_from_response(error(429, "queue_full", "7")).retry_after == 7.0
    proxy = error_from_response(httpx.Response(502, text="<html>bad gateway</html>"), tries=3)
    assert (type(proxy), proxy.code, proxy.status) == (ServiceUnavailable, "http_502", 502)
    assert proxy.message == (
        "502 Bad Gateway from a proxy in front of the service, not from the service (Ray Serve answers so "
        "when the replica handling the request dies), 3 tries made: <html>bad gateway</html>"
    )
    assert type(error_from_response(httpx.Response(404, text="no route"))) is ServiceError
    assert type(error_from_response(httpx.Response(429, text="slow down"))) is RateLimited


def test_a_proxy_s_5xx_is_retried_and_the_service_s_own_500_is_not():
    ray_serve_500 = httpx.Response(500, text="Internal Server Error", headers={"content-type": "text/plain"})
    assert _Retries(RetryPolicy()).after_response(ray_serve_500) is not None
    assert _Retries(RetryPolicy(proxy_errors=False)).after_response(ray_serve_500) is None
    assert _Retries(RetryPolicy()).after_response(error(500, "internal_error")) is None
    transport, seen = scripted([ray_serve_500, httpx.Response(200, json={"status": "success"})])
    with Client("http://svc", retries=FAST, transport=transport) as client:
        assert client.parse(b"%PDF-1.4 not really", use_jobs=False) == {"status": "success"}
    assert [s.rsplit(" ", 1)[0] for s in seen] == ["POST /v1/document/parse"] * 2
    transport, seen = scripted([ray_serve_500] * 3)
    policy = RetryPolicy(attempts=3, backoff=0.001, max_backoff=0.002)
    with Client("http://svc", retries=policy, transport=transport) as client:
        with pytest.raises(ServiceUnavailable, match=r"500 Internal Server Error from a proxy .* 3 tries made"):
            client.job("j1")
    assert len(seen) == 3


def scripted(answers: list) -> tuple[httpx.MockTransport, list[str]]:
    """A transport answering requests in order: an ``httpx.Response`` or an exception to raise."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path} {request.headers.get('authorization')}")
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handle), seen


def test_sync_client_retries_then_raises_typed_errors(monkeypatch):
    monkeypatch.setenv("MINERU_FAST_API_KEY", "from-env")
    refused = httpx.ConnectError("connection refused")
    transport, seen = scripted([refused, error(503, "not_ready", "0"), httpx.Response(200, json={"status": "ok"})])
    with Client("http://svc", retries=FAST, transport=transport) as client:
        assert client.health() == {"status": "ok"}
    assert seen == ["GET /health Bearer from-env"] * 3
    transport, seen = scripted([refused] * 3)
    with Client("http://svc", api_key="k", retries=RetryPolicy(attempts=3, backoff=0.001), transport=transport) as c:
        with pytest.raises(ServiceUnreachable, match="ConnectError"):
            c.ready()
    assert len(seen) == 3
    transport, seen = scripted([error(503, "model_load_failed")])
    with Client("http://svc", retries=FAST, transport=transport) as client, pytest.raises(ServiceUnavailable):
        client.ready()
    assert len(seen) == 1  # not retried: waiting does not cure a failed load


def test_async_client_resubmits_a_lost_job():
    job = {"job_id": "j1", "status": "queued"}
    done = {"job_id": "j2", "status": "done"}
    transport, seen = scripted(
        [
            httpx.Response(202, json=job),
            httpx.ReadError("server went away"),
            error(404, "job_not_found"),  # the restarted server does not know j1
            httpx.Response(202, json=done),
            httpx.Response(200, json=done),
            httpx.Response(200, json={"job_id": "j2", "status": "success", "markdown": "# ok"}),
        ]
    )

    async def run() -> dict:
        async with AsyncClient("http://svc", retries=FAST, poll_interval=0.001, transport=transport) as client:
            return await client.parse(b"%PDF-1.4 not really", pages="1")

    assert asyncio.run(run())["markdown"] == "# ok"
    assert [s.rsplit(" ", 1)[0] for s in seen] == [
        "POST /v1/jobs",
        "GET /v1/jobs/j1",
        "GET /v1/jobs/j1",
        "POST /v1/jobs",
        "GET /v1/jobs/j2",
        "GET /v1/jobs/j2/result",
    ]


def test_one_idempotency_key_per_submission_sent_on_each_of_its_retries():
    job = {"job_id": "j1", "status": "queued"}
    answers = [
        httpx.ReadError("connection reset by peer"),  # the answer lost after the upload
        httpx.Response(500, text="Internal Server Error"),  # a proxy's answer for a dying replica
        httpx.Response(202, json=job),
        httpx.Response(202, json=job),
        httpx.Response(202, json=job),
    ]
    keys: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("idempotency-key"))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with Client("http://svc", retries=FAST, transport=httpx.MockTransport(handle)) as client:
        assert client.submit(b"%PDF-1.4 not really") == job  # three tries of one submission
        assert client.submit(b"%PDF-1.4 not really") == job  # another submission
        assert client.submit(b"%PDF-1.4 not really", idempotency_key="order-7") == job
    assert keys[0] == keys[1] == keys[2] and uuid.UUID(keys[0]).version == 4
    assert keys[3] not in keys[:3] and uuid.UUID(keys[3]).version == 4 and keys[4] == "order-7"


# -- upload re-encoding ------------------------------------------------------------------------------


def test_large_png_is_shrunk_to_exactly_the_page_the_service_renders():
    original = image_bytes(text_page((5000, 3000)), "PNG")
    upload = prepare_upload(original)
    assert upload.reencoded and len(upload.data) < len(original) and upload.name == "document.png"
    sent = Image.open(io.BytesIO(upload.data))
    with open_document(original) as opened:
        served = opened.render(0)
    assert sent.size == served.size == (3500, 2100)
    assert np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(served))


def test_what_is_left_alone_and_what_is_reencoded(tmp_path):
    small = image_bytes(text_page(), "PNG")
    assert prepare_upload(small).data == small
    pdf = pdf_bytes(1)
    assert prepare_upload(pdf, UploadPolicy(max_side=28, max_bytes=1)).data == pdf
    frames = [text_page((4000, 500), seed=i) for i in range(2)]
    tiff = image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:])  # one page per frame
    assert prepare_upload(tiff).data == tiff
    bmp = image_bytes(text_page(), "BMP")  # uncompressed: over max_bytes, shrinks losslessly as PNG
    path = tmp_path / "scan.bmp"
    path.write_bytes(bmp)
    upload = prepare_upload(path, UploadPolicy(max_bytes=len(bmp) - 1))
    assert upload.reencoded and upload.name == "scan.png" and len(upload.data) < len(bmp) / 10
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(upload.data))), np.asarray(text_page()))
    # A rotated JPEG stays JPEG, upright and within the side cap.
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    jpeg = image_bytes(text_page((4000, 3000)), "JPEG", quality=95, exif=exif)
    upload = prepare_upload(jpeg, UploadPolicy(max_side=1000))
    shrunk = Image.open(io.BytesIO(upload.data))
    assert (shrunk.format, shrunk.size) == ("JPEG", (750, 1000))
    missing = tmp_path / "missing.pdf"
    with pytest.raises(DocumentNotFound) as by_client:  # was "cannot read ...: No such file or directory"
        prepare_upload(missing)
    with pytest.raises(DocumentNotFound) as by_parser:
        open_document(missing)
    assert str(by_client.value) == str(by_parser.value) == f"no such file: {missing}"
    assert isinstance(by_client.value, FileNotFoundError) and isinstance(by_client.value, InputError)


# -- the real service ------------------------------------------------------------------------------


@dataclass
class Service:
    """``mineru-fast serve`` on a fixed loopback port, so it can be killed and started again."""

    model: Path
    work: Path
    port: int = field(default_factory=free_port)
    server: Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        keys = self.work / "keys.txt"
        keys.write_text(f"alpha:{KEY}\n")
        command = [sys.executable, "-m", "mineru_fast", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--model", str(self.model), "--preset", "exact", "--threads", "1", "--api-key-file", str(keys),
                   "--workers", "1", "--workers-queue", "1", "--page-window", "1",
                   "--max-new-tokens", BOUNDS]  # fmt: skip
        log_path = self.work / f"server-{time.monotonic_ns()}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.server = Server(self.url, process, log_path)
        wait_ready(self.server, 180)

    def kill(self) -> None:
        assert self.server is not None
        self.server.process.kill()
        self.server.process.wait(30)


@pytest.fixture(scope="module")
def service(tiny_model, tmp_path_factory):
    running = Service(tiny_model, tmp_path_factory.mktemp("client-serve"))
    running.start()
    yield running
    if running.server is not None:
        running.server.stop()


class Recorder(httpx.BaseTransport):
    """httpx's transport, noting every exchange: (start, end, thread, method, path, status or error
    name, Retry-After, request bytes)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.log: list[tuple] = []
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        start, thread = time.monotonic(), threading.get_ident()
        size = int(request.headers.get("content-length", 0))

        def note(outcome: int | str, after: str | None) -> None:
            with self.lock:
                self.log.append(
                    (start, time.monotonic(), thread, request.method, request.url.path, outcome, after, size)
                )

        try:
            response = self.inner.handle_request(request)
        except httpx.TransportError as exc:
            note(type(exc).__name__, None)
            raise
        note(response.status_code, response.headers.get("retry-after"))
        return response

    def close(self) -> None:
        self.inner.close()


def test_parse_jobs_waiting_endpoint_async_and_typed_errors(service):
    recorder = Recorder()
    pdf = pdf_bytes(2)
    with Client(service.url, api_key=KEY, poll_interval=0.2, transport=recorder) as client:
        assert client.health() == {"status": "ok"} and client.ready()["status"] == "ready"
        by_job = client.parse(pdf, formats=["markdown", "json"])
        waited = client.parse(pdf, formats=["markdown", "json"], use_jobs=False, timeout=120)
        # random weights: the status is whatever the bounded pages give, the same both ways
        assert by_job["status"] == waited["status"] and by_job["page_count"] == 2

        def pages(result: dict) -> list:  # what was parsed (timings differ between runs)
            return [(p["size"], p["layout_raw"], p["blocks"]) for p in result["document"]["pages"]]

        assert by_job["markdown"] == waited["markdown"] and pages(by_job) == pages(waited)
        big = image_bytes(text_page((5000, 3000)), "PNG")
        result = client.parse(big)
        assert result["pages"][0]["size"] == [3500, 2100]  # the page the service would have rendered anyway
        uploads = [entry[7] for entry in recorder.log if entry[3] == "POST"]
        assert uploads[-1] < len(big)  # the re-encoded file went up, not the original
        with pytest.raises(DocumentRejected) as rejected:
            client.submit(b"%PDF-1.7 truncated")
        assert rejected.value.code == "corrupt_document" and rejected.value.request_id
        with pytest.raises(JobNotFound):
            client.job("no-such-job")
    with Client(service.url, api_key="wrong-key-000000", retries=FAST) as client:
        with pytest.raises(AuthenticationFailed) as refused:
            client.submit(pdf)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")

    async def run() -> dict:
        async with AsyncClient(service.url, api_key=KEY, poll_interval=0.2) as client:
            return await client.parse(pdf, formats=["markdown", "json"])

    assert pages(asyncio.run(run())) == pages(by_job)


def test_429_storm_honours_retry_after(service):
    recorder = Recorder()
    documents = [pdf_bytes(1)] * 5  # 1 worker + 1 queue place: three of five are refused at first
    with Client(service.url, api_key=KEY, poll_interval=0.2, transport=recorder) as client:
        with ThreadPoolExecutor(len(documents)) as pool:
            results = list(pool.map(client.parse, documents))
    assert [(r["page_count"], len(r["pages"])) for r in results] == [(1, 1)] * len(documents)
    assert len({r["status"] for r in results}) == 1  # the same document gives the same status each time
    refused = [entry for entry in recorder.log if entry[5] == 429]
    assert refused, "no 429 came back: the storm did not fill the queue"
    for _, answered, thread, *_rest, after, _size in refused:
        later = [entry for entry in recorder.log if entry[2] == thread and entry[0] > answered]
        assert later, "a refused submission was not retried"
        assert min(entry[0] for entry in later) - answered >= float(after)  # waited at least Retry-After


@pytest.mark.slow
def test_client_survives_a_server_restart_mid_poll(service):
    recorder = Recorder()
    outcome: dict = {}
    client = Client(service.url, api_key=KEY, poll_interval=0.2, transport=recorder)

    def parse() -> None:
        try:
            outcome["result"] = client.parse(pdf_bytes(4))
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=parse)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while not any(e[3] == "GET" and e[5] == 200 and e[4].startswith("/v1/jobs/") for e in recorder.log):
            assert time.monotonic() < deadline and worker.is_alive(), outcome
            time.sleep(0.05)
        service.kill()  # mid-poll: the job (4 pages) is queued or running
        service.start()
        worker.join(240)
    finally:
        client.close()
    assert not worker.is_alive() and "error" not in outcome, outcome
    assert outcome["result"]["page_count"] == 4 and len(outcome["result"]["pages"]) == 4
    outcomes = [entry[5] for entry in recorder.log]
    assert any(isinstance(o, str) for o in outcomes), "the client never saw the server gone"
    accepted = [entry[4] for entry in recorder.log if entry[3] == "POST" and entry[5] == 202]
    assert accepted == ["/v1/jobs", "/v1/jobs"]  # the lost job was submitted again, once


def test_a_page_range_the_service_clamped_is_a_warning_here_too(caplog):
    """``pages="1-3"`` on a 2-page document: the service clamps it (``inputs.parse_page_range``);
    the client logs the same warning a local parse logs."""
    result = {"status": "success", "metadata": {"input": {"page_count": 2, "pages": [0, 1]}}, "pages": []}

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=result)

    with Client("http://svc", retries=FAST, transport=httpx.MockTransport(handle)) as client:
        with caplog.at_level("WARNING", logger="mineru_fast.inputs.documents"):
            assert client.parse(pdf_bytes(2), pages="1-3", use_jobs=False) == result
            assert client.parse(pdf_bytes(2), pages="1-2", use_jobs=False) == result
    assert [r.getMessage() for r in caplog.records] == ["page range '1-3' clamped to the document's 2 page(s): 1-2"]
