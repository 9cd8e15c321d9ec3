"""The HTTP service: its parts in process, then the real server (uvicorn in a subprocess, 127.0.0.1).

Every request loop here is bounded in count and time; all traffic stays on the loopback address.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import WORKLOAD, need
from PIL import Image
from samples import pdf_bytes, sample_trace, text_page, tiff_with_frame_size
from serve_helpers import BOUNDS, assert_error, read_response_head, running_server, wait_for, workload_page_with_text

from mineru_fast.errors import CorruptDocument, PageRangeError
from mineru_fast.serve.errors import ApiError, from_exception
from mineru_fast.serve.jobs import Job, JobManager, QueueFull, ShuttingDown
from mineru_fast.serve.parsing import parse_formats, trace_from_json
from mineru_fast.serve.security import RateLimiter, TokenBucket, load_api_keys
from mineru_fast.serve.store import MemoryJobStore

ALPHA = "alpha-secret-0123"
BETA = "beta-secret-4567"
PASSWORD = "pw-never-logged-918"
UPLOAD_NAME = "confidential-name-5521.pdf"
MAX_UPLOAD_MB = 3


# -- parts, in process -----------------------------------------------------------------------------


def test_token_bucket_allows_burst_then_refills():
    now = [0.0]
    bucket = TokenBucket(rate_per_minute=60, burst=2, clock=lambda: now[0])
    assert bucket.take() == 0.0 and bucket.take() == 0.0
    assert bucket.take() == pytest.approx(1.0)  # one token per second
    now[0] = 0.5
    assert bucket.take() == pytest.approx(0.5)
    now[0] = 1.0
    assert bucket.take() == 0.0

    limiter = RateLimiter(rate_per_minute=0, burst=1, max_clients=2, clock=lambda: now[0])
    assert all(limiter.check("anyone") == 0.0 for _ in range(50))  # 0 = unlimited
    assert limiter.check("slow", rate=60) == 0.0 and limiter.check("slow", rate=60) > 0
    limiter.check("a", rate=60), limiter.check("b", rate=60)
    assert "slow" not in limiter._buckets and len(limiter._buckets) == 2  # bounded memory


def test_api_key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# service keys\nalpha:alpha-secret-0123\n\n  beta : beta-secret-4567 : 30 \n# slow key above\n")
    alpha, beta = load_api_keys(path)
    assert (alpha.name, alpha.rate, beta.name, beta.rate) == ("alpha", None, "beta", 30.0)
    assert b"alpha-secret" not in alpha.digest
    for bad in ["alpha", "alpha:short", "a:longenough-secret:fast", "a:longenough-secret\na:other-secret-1"]:
        path.write_text(bad)
        with pytest.raises(ValueError) as info:
            load_api_keys(path)
        assert "secret-1" not in str(info.value) and "longenough" not in str(info.value)  # never echoes secrets
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        load_api_keys(path)


def test_api_key_file_grammar_is_strict(tmp_path):
    """A '#' inside a secret cut it short (its 8-character prefix authenticated), and a rate of
    'nan' was accepted and switched that key's limit off."""
    path = tmp_path / "keys.txt"
    path.write_text("alpha:abc#defgh-1234\nbeta:beta-secret-4567:0.5\ngamma:gamma-secret-89:0\n")
    alpha, beta, gamma = load_api_keys(path)
    assert alpha.digest == hashlib.sha256(b"abc#defgh-1234").digest()  # '#' belongs to the secret
    assert (beta.rate, gamma.rate) == (0.5, 0.0)
    refused = {
        "alpha:zqxw-secret-77 # a remark": "line 2: SECRET",
        "alpha:zqxw-secret-77:30 # slow": "line 2: RATE",
        "alpha:zqxw-secret-77:nan": "line 2: RATE",
        "alpha:zqxw-secret-77:inf": "line 2: RATE",
        "alpha:zqxw-secret-77:-1": "line 2: RATE",
        "alpha:zqxw-secret-77:1e3": "line 2: RATE",
        "alpha:zqxw-secret-77:": "line 2: RATE",
        "al pha:zqxw-secret-77": "line 2: NAME",
        "alpha:zqxw:secret-77:3:4": "line 2: expected NAME:SECRET",
        "alpha:zqxwé-secret-77": "line 2: SECRET",
    }
    for line, message in refused.items():
        path.write_text(f"# header\n{line}\n")
        with pytest.raises(ValueError, match=message) as info:
            load_api_keys(path)
        assert "zqxw" not in str(info.value) and "remark" not in str(info.value)  # no line text echoed


def test_api_key_file_with_a_utf8_bom_is_read(tmp_path):
    """A file saved by an editor that writes a byte order mark (Windows Notepad) was refused with
    'line 1: NAME must be ...' for a name that is right."""
    path = tmp_path / "keys.txt"
    path.write_bytes(b"\xef\xbb\xbfalpha:alpha-secret-0123\nbeta:beta-secret-4567:30\n")
    alpha, beta = load_api_keys(path)
    assert (alpha.name, alpha.digest, beta.rate) == ("alpha", hashlib.sha256(ALPHA.encode()).digest(), 30.0)
    path.write_bytes(b"\xef\xbb\xbf# keys\nalpha:alpha-secret-0123\n")  # a comment first: still a comment
    assert [k.name for k in load_api_keys(path)] == ["alpha"]


def test_serve_settings_refuse_non_finite_numbers(tmp_path):
    from mineru_fast.serve.config import ServeConfig

    names = ("rate_limit", "max_upload_mb", "result_ttl", "drain_timeout", "header_timeout", "min_body_rate")
    for name in (*names, "decode_budget_mb", "body_timeout", "write_timeout", "max_response_buffer_mb"):
        for value in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match=name):
                ServeConfig(**{name: value})
    for name in ("write_timeout", "max_response_buffer_mb"):  # 0 re-armed the write guard at once: a spin
        with pytest.raises(ValueError, match=name):
            ServeConfig(**{name: 0.0})


def test_error_mapping_and_request_fields():
    assert from_exception(CorruptDocument("document: not a readable PDF")).status == 422
    assert from_exception(PageRangeError("x")).code == "bad_page_range"
    crash = from_exception(RuntimeError("secret internals"))
    assert crash.status == 500 and "secret internals" not in crash.message
    assert parse_formats(None) == {"markdown", "middle_json"}  # MinerU 4's bundle: Markdown and middle JSON
    assert parse_formats("layout, json") == {"layout", "json"}
    with pytest.raises(ApiError) as info:
        parse_formats("markdown,pdf")
    assert info.value.status == 422 and "pdf" in info.value.message
    trace = trace_from_json(b'{"pages": [{"layout": "L", "contents": ["a", null]}]}')
    assert trace.pages[0].contents == ["a", None]
    for bad in [
        b"not json",
        b'{"pages": 3}',
        b'{"pages": [{"layout": 1}]}',
        b'{"pages": [{"layout": "", "contents": [1]}]}',
    ]:
        with pytest.raises(Exception) as info:
            trace_from_json(bad)
        assert from_exception(info.value).code == "bad_replay_trace"


def test_job_manager_bounds_queue_and_expires_results():
    gate = threading.Event()

    def runner(job: Job) -> dict:
        assert gate.wait(10)
        job.report_progress(1, 1)
        return {"n": job.payload}

    now = [0.0]
    store = MemoryJobStore(result_ttl=5, clock=lambda: now[0])
    manager = JobManager([runner], max_queued=2, store=store)
    manager.start()
    try:
        first = manager.submit(Job(1, owner="alpha"))
        assert wait_for(lambda: first.status == "running", 5)
        # the POST answer is made of the job: it was "running" with started_at null
        described = first.to_record("here").describe(None)
        assert described["status"] == "running" and described["started_at"] is not None
        second, third = manager.submit(Job(2, owner="alpha")), manager.submit(Job(3, owner="alpha"))
        with pytest.raises(QueueFull) as info:
            manager.submit(Job(4))
        assert info.value.retry_after >= 1
        assert (manager.queue_length, manager.in_flight, manager.queue_position(third.id)) == (2, 1, 2)
        assert store.get(first.id, owner="beta") is None and store.get(first.id, owner="alpha").id == first.id
        finished = threading.Event()
        third.add_done_callback(lambda job: finished.set())
        gate.set()
        assert finished.wait(10)
        assert [j.status for j in (first, second, third)] == ["done"] * 3
        stored = store.get(third.id, owner="alpha", with_result=True)
        assert third.result == stored.result == {"n": 3} and third.payload is None
        assert stored.describe()["pages"] == {"total": 1, "done": 1} and stored.describe()["attempts"] == 1
        late = []
        third.add_done_callback(late.append)  # already finished: called at once
        assert late == [third]
        now[0] = 4.9
        assert store.expire() == 0
        now[0] = 100.0
        assert store.expire() == 3 and store.get(first.id, owner="alpha") is None
    finally:
        gate.set()
        manager.shutdown(5)


def test_job_manager_failures_and_shutdown():
    gate = threading.Event()

    def runner(job: Job) -> dict:
        if job.payload == "corrupt":
            raise CorruptDocument("document: not a readable PDF")
        if job.payload == "crash":
            raise RuntimeError("boom")
        assert gate.wait(10)
        return {}

    manager = JobManager([runner], max_queued=4, store=MemoryJobStore(result_ttl=60))
    manager.start()
    corrupt, crash = manager.submit(Job("corrupt")), manager.submit(Job("crash"))
    assert wait_for(lambda: crash.status == "failed", 5)
    assert (corrupt.error.status, corrupt.error.code) == (422, "corrupt_document")
    assert (crash.error.status, crash.error.code) == (500, "internal_error")

    running, waiting = manager.submit(Job("slow")), manager.submit(Job("slow"))
    assert wait_for(lambda: running.status == "running", 5)
    cancelled = manager.shutdown(drain_timeout=0.3)  # the running job outlives the drain time
    assert running.status == "running"  # shutdown returned without waiting for it
    assert cancelled == [waiting] and waiting.status == "cancelled" and waiting.error.code == "shutting_down"
    with pytest.raises(ShuttingDown):
        manager.submit(Job("late"))
    gate.set()
    assert wait_for(lambda: running.status == "done", 5)  # a started job is never abandoned


# -- the real server -------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx", reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")
for _module in ("fastapi", "uvicorn", "prometheus_client", "multipart"):
    pytest.importorskip(_module, reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    keys = work / "keys.txt"
    keys.write_text(f"alpha:{ALPHA}\nbeta:{BETA}:6\n")
    args = [
        "--api-key-file",
        str(keys),
        "--workers",
        "1",  # the queue tests below count on one job at a time
        "--workers-queue",
        "2",
        "--rate-burst",
        "2",
        "--max-upload-mb",
        str(MAX_UPLOAD_MB),
        "--allow-replay",
        "--max-new-tokens",
        BOUNDS,
        "--page-window",
        "1",
        "--result-ttl",
        "120",
        "--drain-timeout",
        "600",  # the drain test waits on states: a bound on a hang, not a wait
        "--render-timeout",
        "10",  # a normal page renders in well under a second; the bomb below needs minutes
    ]
    with running_server(tiny_model, work, *args) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers={"X-API-Key": ALPHA}, timeout=300) as c:
        yield c


def metrics(client) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def upload(data: bytes, name: str = UPLOAD_NAME, replay: int | None = None, **fields: str) -> dict:
    """Multipart fields of a parse upload; ``replay``: attach ``sample_trace(replay)`` (a page
    status that does not depend on what random weights decode)."""
    files = {"file": (name, data, "application/octet-stream")}
    if replay is not None:
        files["replay"] = ("trace.json", json.dumps(sample_trace(replay).to_dict()).encode(), "application/json")
    return {"files": files, "data": fields}


def test_health_ready_page_metrics_and_request_ids(server, client):
    health = httpx.get(f"{server.url}/health")  # no key needed
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert len(health.headers["x-request-id"]) == 32
    ready = client.get("/ready").json()
    assert ready["status"] == "ready" and ready["workers"] == 1 and ready["engine"] == "fast"
    assert ready["model"] == server_model_name(server)  # the directory's name, never its path
    assert "/" not in client.get("/ready").text.replace("\\/", "")
    assert ready["engine_check"]["seconds"] > 0 and ready["engine_check"]["image_tokens"] == 16
    assert ready["canary"]["mode"] == "after-ready"  # parsed in the background once ready
    assert wait_for(lambda: client.get("/ready").json()["canary"]["state"] == "passed", 300)
    assert client.get("/ready").json()["canary"]["seconds"] > 0

    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="upload"' in page.text and 'id="markdown"' in page.text
    # MinerU's licence (section 2): a service built on it says so, visibly, in its interface
    assert 'Powered by <a href="https://github.com/opendatalab/MinerU">MinerU</a>' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]

    assert client.get("/health", headers={"X-Request-ID": "client-id-42"}).headers["x-request-id"] == "client-id-42"
    assert len(client.get("/health", headers={"X-Request-ID": "bad id!"}).headers["x-request-id"]) == 32
    assert_error(client.get("/no/such/route"), 404, "not_found")
    assert_error(client.delete("/health"), 405, "method_not_allowed")

    values = metrics(client)
    assert metric(values, "mineru_fast_ready") == 1.0
    assert metric(values, "mineru_fast_model_load_seconds") > 0 and metric(values, "mineru_fast_canary_seconds") > 0
    assert metric(values, "mineru_fast_engine_check_seconds") > 0
    assert metric(values, "mineru_fast_requests_total", route="/health", method="GET", status="200") >= 3


def server_model_name(server) -> str:
    command = server.process.args
    return command[command.index("--model") + 1].rstrip("/").rsplit("/", 1)[-1]


def test_metric_labels_stay_bounded_whatever_the_method(server, client):
    """Requests were labelled by their raw method: 5,000 made-up methods grew /metrics to 2.9 MB."""
    before = client.get("/metrics").content
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # one kept-alive connection
        for n in range(200):
            sock.sendall(f"FOO{n} /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            reply = b""
            while not reply.endswith(b"}"):  # each answer is a short JSON body
                chunk = sock.recv(4096)
                assert chunk, reply
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 405"), reply[:100]
    values = metrics(client)
    assert metric(values, "mineru_fast_requests_total", route="/health", method="other", status="405") == 200
    assert not [labels for (_, labels) in values if any(v.startswith("FOO") for _, v in labels)]
    assert len(client.get("/metrics").content) < len(before) + 2000  # one new series, not 200


def test_long_page_range_is_refused_at_once_with_a_short_answer(client):
    """A 1 MB page range cost 15 s of CPU before its 422, which echoed the whole value (500 KB)."""
    pages = "1-1," * 250_000
    response = client.post("/v1/jobs", **upload(pdf_bytes(1), pages=pages))
    error = assert_error(response, 422, "bad_page_range")
    assert "1,000,000 characters long; the limit is 4,096" in error["message"]
    assert len(response.content) < 500


def test_sync_parse_results_are_not_kept(server, client):
    """A synchronous call's result stayed stored for --result-ttl and could be fetched by its id."""
    response = client.post("/v1/document/parse", headers={"X-Request-ID": "sync-not-kept-1"}, **upload(pdf_bytes(1)))
    assert response.status_code == 200, response.text
    body = response.json()  # the default parts: MinerU 4's Markdown and middle JSON (no content list)
    assert "markdown" in body and "content_list" not in body
    middle = body["middle_json"]
    assert middle["schema"] == "docvortex.middle" and [p["page_idx"] for p in middle["pages"]] == [0]
    assert middle["extensions"]["mineru_fast"]["status"] == body["status"]
    (queued,) = [r for r in server.log_records() if r.get("request_id") == "sync-not-kept-1" and "job_id" in r][:1]
    assert_error(client.get(f"/v1/jobs/{queued['job_id']}"), 404, "job_not_found")
    assert_error(client.get(f"/v1/jobs/{queued['job_id']}/result"), 404, "job_not_found")


def test_wrong_api_key_is_401_and_rate_limits_per_key(server, client):
    wrong = httpx.post(f"{server.url}/v1/jobs", headers={"X-API-Key": "not-a-valid-key"}, **upload(pdf_bytes(1)))
    assert_error(wrong, 401, "invalid_api_key")
    assert "not-a-valid-key" not in wrong.text
    missing = httpx.get(f"{server.url}/v1/jobs/whatever")
    assert_error(missing, 401, "missing_api_key")
    assert missing.headers["www-authenticate"] == "Bearer"
    bearer = httpx.get(f"{server.url}/v1/jobs/whatever", headers={"Authorization": f"Bearer {ALPHA}"})
    assert_error(bearer, 404, "job_not_found")

    job = client.post("/v1/jobs", **upload(pdf_bytes(1))).json()
    with httpx.Client(base_url=server.url, headers={"X-API-Key": BETA}, timeout=30) as beta:
        assert_error(beta.get(f"/v1/jobs/{job['job_id']}"), 404, "job_not_found")  # alpha's job is not beta's
        assert_error(beta.get("/v1/jobs/unknown"), 404, "job_not_found")
        limited = beta.get("/v1/jobs/unknown")  # beta: burst 2, then 6 per minute
        assert_error(limited, 429, "rate_limited")
        assert 1 <= int(limited.headers["retry-after"]) <= 10
    assert client.get(f"/v1/jobs/{job['job_id']}").status_code == 200  # alpha is not limited


@pytest.mark.parametrize("endpoint", ["/v1/document/parse", "/v1/jobs"])
def test_broken_or_unsupported_documents_are_422(server, client, endpoint):
    queued_before = sum(r["message"] == "job queued" for r in server.log_records())
    truncated = assert_error(client.post(endpoint, **upload(pdf_bytes(2)[:600])), 422, "corrupt_document")
    assert "not a readable PDF" in truncated["message"]
    assert UPLOAD_NAME not in truncated["message"]
    unsupported = assert_error(client.post(endpoint, **upload(bytes(range(256)) * 16)), 422, "unsupported_format")
    assert "not a PDF or a supported image format" in unsupported["message"]
    empty = assert_error(client.post(endpoint, **upload(b"")), 422, "corrupt_document")
    assert "empty" in empty["message"]
    pages = assert_error(client.post(endpoint, **upload(pdf_bytes(1), pages="9")), 422, "bad_page_range")
    assert "outside 1-1" in pages["message"]
    assert_error(client.post(endpoint, **upload(pdf_bytes(1), formats="docx")), 422, "invalid_request")
    assert_error(client.post(endpoint, data={"pages": "1"}), 422, "invalid_request")  # no file
    trace = {"replay": ("t.json", b"{not json", "application/json")}
    bad_trace = client.post(endpoint, files={"file": ("a.pdf", pdf_bytes(1)), **trace})
    assert_error(bad_trace, 422, "bad_replay_trace")
    assert sum(r["message"] == "job queued" for r in server.log_records()) == queued_before  # refused up front


def test_an_oversized_later_tiff_frame_fails_alone_like_the_sdk(client):
    """serve refused the whole TIFF with 422 when a later frame's header was over the pixel limit,
    where the SDK and the CLI fail that page alone."""
    frames = [text_page(size=(300, 400)), Image.new("1", (64, 64), 1)]
    bomb = tiff_with_frame_size(frames, 1, (20000, 20000), compression="tiff_deflate")
    response = client.post("/v1/document/parse", **upload(bomb, "scan.tiff", replay=2))
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["status"] == "partial"
    first, second = result["pages"]
    assert (first["status"], first["size"]) == ("success", [300, 400])
    assert second["status"] == "failure" and second["errors"][0]["code"] == "image_too_large"
    assert "frame 2 is 20000x20000" in second["errors"][0]["message"]


def test_sync_parse_returns_markdown_content_list_and_layout(client):
    response = client.post(
        "/v1/document/parse", **upload(pdf_bytes(1), replay=1, formats="markdown,content_list,json,layout")
    )
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["request_id"] == response.headers["x-request-id"]
    assert result["status"] == "success" and result["page_count"] == 1
    assert result["pages"][0]["size"][0] > 0 and result["pages"][0]["status"] == "success"
    assert "A replayed paragraph of body text." in result["markdown"]
    assert any(item.get("text") == "A replayed title" for item in result["content_list"])
    assert result["document"]["pages"][0]["page_idx"] == 0 and result["timings"]["wall"] > 0
    (overlay,) = result["layout"]
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(overlay["data"])))
    assert image.format == "JPEG" and image.size == (overlay["width"], overlay["height"])


def test_replayed_workload_page_returns_expected_markdown(client, workload_traces):
    from test_end_to_end import assert_replayed_outputs

    need(WORKLOAD)
    found = workload_page_with_text(workload_traces, MAX_UPLOAD_MB * 1024 * 1024 - 100_000)
    if found is None:
        pytest.skip("no workload page with text fits the upload limit")
    image, trace_path, blocks, trace = found
    files = {
        "file": (image.name, image.read_bytes(), "image/jpeg"),
        "replay": (trace_path.name, trace_path.read_bytes(), "application/json"),
    }
    response = client.post("/v1/document/parse", files=files, data={"formats": "markdown,content_list,json"})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["status"] == "success", result["pages"]
    (page,) = result["document"]["pages"]
    assert page["layout_raw"] == trace.layout and len(blocks) == len(trace.contents)

    assert_replayed_outputs(result["markdown"], result["content_list"], trace, image.name)
    assert result["content_list"] and all(0 <= v <= 1000 for item in result["content_list"] for v in item["bbox"])


def test_job_progress_and_result(client):
    submitted = client.post("/v1/jobs", **upload(pdf_bytes(3), formats="markdown"))
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert submitted.headers["location"] == f"/v1/jobs/{job['job_id']}" == job["status_url"]
    assert job["status"] in ("queued", "running") and job["pages"]["total"] == 3
    seen_done, statuses = [], set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = client.get(job["status_url"]).json()
        statuses.add(state["status"])
        seen_done.append(state["pages"]["done"])
        if state["status"] not in ("queued", "running"):
            break
        if state["status"] == "running":
            early = client.get(job["result_url"])
            if early.status_code == 409:
                assert_error(early, 409, "job_not_finished")
        time.sleep(0.05)
    assert state["status"] == "done" and state["pages"] == {"total": 3, "done": 3}, state
    assert seen_done == sorted(seen_done) and set(seen_done) <= {0, 1, 2, 3}  # forward, page by page
    assert {1, 2} & set(seen_done), seen_done  # --page-window 1: progress seen between pages
    result = client.get(job["result_url"])
    assert result.status_code == 200
    body = result.json()
    assert body["job_id"] == job["job_id"] and body["page_count"] == 3
    assert [p["page_idx"] for p in body["pages"]] == [0, 1, 2] and "markdown" in body and "content_list" not in body


def test_oversize_upload_is_413_before_it_is_read(server):
    limit = MAX_UPLOAD_MB * 1024 * 1024
    total = 256 * 1024 * 1024
    sent = 0

    def body():
        nonlocal sent
        head = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.pdf"\r\n\r\n%PDF-1.4\n'
        sent += len(head)
        yield head
        chunk = b"\0" * 65536
        while sent < total:
            sent += len(chunk)
            yield chunk

    headers = {"X-API-Key": ALPHA, "Content-Type": "multipart/form-data; boundary=xyz"}
    response = httpx.post(f"{server.url}/v1/document/parse", content=body(), headers=headers, timeout=60)
    error = assert_error(response, 413, "payload_too_large")
    assert f"{MAX_UPLOAD_MB} MiB" in error["message"]
    assert limit < sent < total // 4, f"sent {sent} bytes of {total}"  # answered early, the rest never sent

    # A declared Content-Length over the limit is refused from the headers alone.
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request = (
            f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {ALPHA}\r\n"
            f"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: {50 * limit}\r\n\r\n"
        )
        sock.sendall(request.encode() + b"--xyz\r\n")
        reply = read_response_head(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200  # the server is fine


@pytest.mark.slow
def test_a_render_bomb_page_fails_alone_with_render_timeout(client):
    """A small PDF of stroked lines rendered for minutes under the process-wide PDFium lock."""
    from samples import stroked_lines_pdf

    bomb = stroked_lines_pdf([1_000_000, 10])
    response = client.post("/v1/document/parse", **upload(bomb, replay=2))
    assert response.status_code == 200, response.text
    result = response.json()
    first, second = result["pages"]
    assert first["status"] == "failure" and first["errors"][0]["code"] == "render_timeout"
    assert "took longer than 10 s to render" in first["errors"][0]["message"]
    assert second["status"] == "success" and result["status"] == "partial"


@pytest.mark.slow
def test_a_document_of_render_bombs_holds_its_worker_for_two_render_timeouts(client):
    """Audit round 4, N2: 20 pages sharing one slow content stream held the only worker 20 x
    ``--render-timeout``; two pages time out, the others fail at once unrendered, each reported."""
    from samples import stroked_lines_pdf

    bomb = stroked_lines_pdf([1_000_000] * 5)
    response = client.post("/v1/document/parse", **upload(bomb, replay=5))
    assert response.status_code == 200, response.text
    pages = response.json()["pages"]
    assert [p["status"] for p in pages] == ["failure"] * 5
    assert {p["errors"][0]["code"] for p in pages} == {"render_timeout"}
    messages = [p["errors"][0]["message"] for p in pages]
    assert all("took longer than 10 s to render" in m for m in messages[:2])
    assert all("not rendered: 2 pages of this document took longer" in m for m in messages[2:])
    assert client.post("/v1/document/parse", **upload(pdf_bytes(1), replay=1)).json()["status"] == "success"


@pytest.mark.slow
def test_burst_beyond_queue_gets_429_while_accepted_jobs_complete(server, client):
    blocker = client.post("/v1/jobs", **upload(pdf_bytes(4), replay=4)).json()  # keeps the one worker busy
    assert wait_for(lambda: client.get(blocker["status_url"]).json()["status"] == "running", 300)
    before = metrics(client)
    burst = 10
    document = pdf_bytes(1)
    barrier = threading.Barrier(burst)

    def submit(_: int):
        with httpx.Client(base_url=server.url, headers={"X-API-Key": ALPHA}, timeout=300) as c:
            barrier.wait(timeout=300)
            return c.post("/v1/jobs", **upload(document, "doc.pdf", replay=1))

    with ThreadPoolExecutor(burst) as pool:
        responses = list(pool.map(submit, range(burst)))
    during = metrics(client)
    accepted = [r.json()["job_id"] for r in responses if r.status_code == 202]
    rejected = [r for r in responses if r.status_code != 202]
    assert accepted and rejected, [r.status_code for r in responses]
    for r in rejected:
        assert_error(r, 429, "queue_full")
        assert 1 <= int(r.headers["retry-after"]) <= 120
    assert 1 <= metric(during, "mineru_fast_queue_length") <= 2  # the queue holds at most --workers-queue 2
    assert metric(during, "mineru_fast_jobs_in_flight") <= 1  # one worker

    pending, deadline = {*accepted, blocker["job_id"]}, time.monotonic() + 600  # a bound on a hang (load 18: ~150 s)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            state = client.get(f"/v1/jobs/{job_id}").json()
            if state["status"] not in ("queued", "running"):
                assert state["status"] == "done" and state["pages"]["done"] == state["pages"]["total"], state
                assert client.get(f"/v1/jobs/{job_id}/result").json()["status"] == "success"
                pending.discard(job_id)
        time.sleep(0.1)
    assert not pending, f"jobs not finished: {pending}"

    after = metrics(client)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("mineru_fast_jobs_total", status="done") == len(accepted) + 1  # + the blocker
    assert moved("mineru_fast_jobs_total", status="rejected") == len(rejected)
    assert moved("mineru_fast_pages_total", status="success") == len(accepted) + 4
    assert moved("mineru_fast_requests_total", route="/v1/jobs", method="POST", status="429") == len(rejected)
    assert moved("mineru_fast_requests_total", route="/v1/jobs", method="POST", status="202") == len(accepted)
    assert metric(after, "mineru_fast_queue_length") == 0 and metric(after, "mineru_fast_jobs_in_flight") == 0
    assert metric(after, "mineru_fast_parse_duration_seconds_count") >= len(accepted)


@pytest.mark.slow
def test_sigterm_drains_jobs_results_stay_fetchable_then_exit_0_and_json_logs(server, client):
    """Runs last: it stops the module's server. On SIGTERM the listener closed at once while queued
    jobs were still parsed, and their results were thrown away at exit."""
    queued = client.post("/v1/jobs", **upload(pdf_bytes(2), replay=2)).json()
    sync_result = {}

    def parse_during_shutdown():
        response = httpx.post(
            f"{server.url}/v1/document/parse",
            headers={"X-Request-ID": "shutdown-sync-1", "X-API-Key": ALPHA},
            timeout=600,
            **upload(pdf_bytes(1), replay=1, password=PASSWORD),
        )
        sync_result["status"] = response.status_code
        sync_result["body"] = response.json()

    thread = threading.Thread(target=parse_during_shutdown)
    thread.start()

    def logged(message: str, request_id: str | None = None) -> bool:
        return any(
            r["message"] == message and (request_id is None or r.get("request_id") == request_id)
            for r in server.log_records()
        )

    assert wait_for(lambda: logged("job queued", "shutdown-sync-1"), 300)
    server.process.send_signal(signal.SIGTERM)  # while both jobs are queued or running
    assert wait_for(lambda: logged("draining"), 300)

    assert_error(client.post("/v1/jobs", **upload(pdf_bytes(1))), 503, "shutting_down")  # no new work
    assert_error(client.post("/v1/document/parse", **upload(pdf_bytes(1))), 503, "shutting_down")
    assert_error(httpx.get(f"{server.url}/ready"), 503, "shutting_down")
    assert httpx.get(f"{server.url}/health").status_code == 200

    def queued_job_done() -> bool:
        return client.get(queued["status_url"]).json()["status"] == "done"  # status served while draining

    assert wait_for(queued_job_done, 600, interval=0.1)
    assert server.process.poll() is None  # its result has not been fetched yet: still serving
    result = client.get(queued["result_url"])
    assert result.status_code == 200 and result.json()["status"] == "success"
    code = server.process.wait(timeout=600)  # all collected: the server stops by itself
    thread.join(timeout=600)
    assert code == 0
    assert sync_result.get("status") == 200 and sync_result["body"]["status"] == "success"

    records = server.log_records()
    lines = server.log_lines()
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")][:5]
    finished = {r["job_id"]: r["status"] for r in records if r["message"] == "job finished"}
    assert finished[queued["job_id"]] == "done"
    messages = [r["message"] for r in records]
    assert {
        "model loaded",
        "engine check passed",
        "ready",
        "canary page parsed",
        "draining",
        "drained",
        "stopped",
    } <= set(messages)
    assert messages.index("drained") < messages.index("stopped")
    requests = [r for r in records if r["message"] == "request"]
    assert all(r.get("request_id") and r.get("status") for r in requests)
    assert any(r["request_id"] == "shutdown-sync-1" and r["status"] == 200 for r in requests)
    text = "\n".join(lines)
    for secret in (PASSWORD, UPLOAD_NAME, ALPHA, BETA, "Synthetic page 0"):
        assert secret not in text


def test_the_replaced_pixel_budget_flag_names_its_replacement(capsys):
    from mineru_fast.cli.main import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--pixel-budget", "600"])
    assert stopped.value.code == 2 and "--pixel-budget was replaced by --decode-budget-mb" in capsys.readouterr().err


def test_the_body_buffer_defaults_to_one_upload_per_job_and_is_set_from_the_command_line():
    import argparse

    from mineru_fast.cli.serve import add_serve_command, config_from_args
    from mineru_fast.serve.config import ServeConfig

    mib = 1024 * 1024
    default = ServeConfig()  # 50 MiB x (4 workers + 8 queued)
    assert (default.max_body_buffer_bytes, default.key_body_buffer_bytes) == (600 * mib, 150 * mib)
    small = ServeConfig(max_upload_mb=3, workers=1, queue_size=2)  # a quarter is under one upload
    assert (small.max_body_buffer_bytes, small.key_body_buffer_bytes) == (9 * mib, 3 * mib)
    tight = ServeConfig(max_body_buffer_mb=2)  # under one upload: a key may hold it all
    assert (tight.max_body_buffer_bytes, tight.key_body_buffer_bytes) == (2 * mib, 2 * mib)
    for value in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="max_body_buffer_mb"):
            ServeConfig(max_body_buffer_mb=value)
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    args = parser.parse_args(["serve", "--max-body-buffer-mb", "100"])
    assert config_from_args(args).max_body_buffer_bytes == 100 * mib
    assert config_from_args(parser.parse_args(["serve"])).max_body_buffer_mb is None
