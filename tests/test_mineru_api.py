"""MinerU 4's v1 document API on ``mineru-fast serve``: its parts in process, then the real server
(a subprocess on 127.0.0.1, tiny model; documents named after a trace of ``--replay DIR`` are
replayed, so the outputs are known and equal what ``/v1/document/parse`` gives for the same trace).

MinerU's own client against it is the official lane's (``test_official_api_client``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import time
import zipfile

import pytest
from samples import pdf_bytes, sample_trace
from serve_helpers import BOUNDS, assert_error, read_response_head, running_server

from mineru_fast.errors import PageRangeError
from mineru_fast.serve.errors import ApiError

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")

from mineru_fast.serve.metrics import route_label  # noqa: E402
from mineru_fast.serve.mineru_api import needs_page_count, page_spec  # noqa: E402
from mineru_fast.serve.mineru_files import FileStore  # noqa: E402

ALPHA = "alpha-secret-0123"
BETA = "beta-secret-4567"
MAX_UPLOAD_MB = 3
PAGES = 2  # pages of the replayed documents
REPLAYED = "report"  # the stem of the replayed documents' name (its trace is REPLAYED.json)


# -- parts, in process -----------------------------------------------------------------------------


def test_mineru_page_ranges_become_mineru_fast_ranges():
    assert page_spec(None) is None and page_spec("  ") is None and page_spec("all") is None
    assert page_spec("1-5, 8") == "1-5,8" and page_spec("3") == "3"
    assert page_spec("r3-r1", page_count=10) == "8-10" and page_spec("2-r2", page_count=10) == "2-9"
    assert page_spec("r1", page_count=4) == "4" and page_spec("r9-r2,1", page_count=4) == "1-3,1"
    assert needs_page_count("1,r2") and not needs_page_count("1-4") and not needs_page_count("all")
    for bad in ("3-1", "r1-r3", "0", "1~3", "-2", "a", "1-2-3"):
        with pytest.raises(PageRangeError):
            page_spec(bad, page_count=10)
    with pytest.raises(PageRangeError, match="selects no page"):
        page_spec("r9-r8", page_count=4)
    with pytest.raises(PageRangeError, match="characters long"):
        page_spec("1," * 5000)
    with pytest.raises(ValueError, match="page count"):
        page_spec("r1")


def test_file_store_bounds_owners_expiry_and_repeats():
    now = [1000.0]
    store = FileStore(max_bytes=100, ttl=60, max_records=4, key_bytes=80, key_records=4, clock=lambda: now[0])
    data = b"x" * 40
    digest = hashlib.sha256(data).hexdigest()
    upload = store.create_upload("alpha", "a.pdf", 40, "application/pdf", "parse", digest, lifetime=3600)
    assert upload.status == "pending" and upload.expires_at == 1060 and upload.kept_until == 1060  # capped at ttl
    with pytest.raises(ApiError) as info:
        store.complete("alpha", upload.id, digest)
    assert (info.value.status, info.value.code) == (409, "upload_not_ready")
    with pytest.raises(ApiError) as info:
        store.put_content("alpha", upload.id, data[:-1])
    assert info.value.code == "upload_size_mismatch"
    with pytest.raises(ApiError) as info:
        store.get_upload("beta", upload.id)  # another key's
    assert (info.value.status, info.value.code) == (404, "upload_not_found")
    assert store.held_bytes() == 0  # a declaration holds no bytes
    store.put_content("alpha", upload.id, data)
    store.put_content("alpha", upload.id, data)  # a repeat replaces the bytes, it does not add them
    assert store.held_bytes() == 40 == store.held_bytes("alpha") and store.held_bytes("beta") == 0
    with pytest.raises(ApiError) as info:
        store.complete("alpha", upload.id, "0" * 64)
    assert info.value.code == "file_hash_mismatch"
    done = store.complete("alpha", upload.id, digest)
    assert done.status == "completed" and done.file is not None and done.file.data == data
    with pytest.raises(ApiError) as info:
        store.complete("alpha", upload.id, digest)
    assert (info.value.status, info.value.code) == (409, "upload_already_terminal")
    again = store.create_upload("alpha", "b.pdf", 40, "application/pdf", "parse", digest)
    assert again.status == "completed" and again.file is done.file  # the same bytes: no second copy
    assert store.held_bytes() == 40
    other = store.create_upload("beta", "a.pdf", 40, "application/pdf", "parse", digest)
    assert other.status == "pending"  # beta does not see alpha's file
    store.put_content("beta", other.id, data)
    with pytest.raises(ApiError) as info:
        store.create_upload("beta", "c.pdf", 30, "application/pdf", "parse", None)  # 40 + 40 + 30 > 100
    assert (info.value.status, info.value.code) == (429, "upload_store_full")
    assert 1 <= int(info.value.headers["Retry-After"]) <= 60
    now[0] += 61  # everything expired
    assert store.held_bytes() == 0
    with pytest.raises(ApiError) as info:
        store.get_file("alpha", done.file.id)
    assert info.value.code == "file_not_found"
    for _ in range(4):
        store.create_upload("alpha", "d.pdf", 1, "application/pdf", "parse", None)
    with pytest.raises(ApiError) as info:  # records are bounded too
        store.create_upload("alpha", "d.pdf", 1, "application/pdf", "parse", None)
    assert info.value.code == "upload_quota_exceeded"


def test_one_key_cannot_fill_the_upload_store():
    """Audit round 4, N1: declarations cost no bytes and expire within ``pending_ttl`` unless
    their bytes come; bytes and records are bounded per key, so a key filling its quota leaves
    room for the others (on 44d1b50 the declared sizes filled the store for every key)."""
    now = [1000.0]
    store = FileStore(max_bytes=100, ttl=600, max_records=16, key_bytes=50, key_records=4, clock=lambda: now[0])
    for _ in range(4):  # the attacker's declarations: its whole quota each, no bytes sent
        store.create_upload("mallory", "x.pdf", 50, "application/pdf", "parse", None, lifetime=3600)
    with pytest.raises(ApiError) as info:
        store.create_upload("mallory", "x.pdf", 1, "application/pdf", "parse", None)
    assert (info.value.status, info.value.code) == (429, "upload_quota_exceeded")
    assert 1 <= int(info.value.headers["Retry-After"]) <= 60  # its declarations expire within a minute
    honest = store.create_upload("alpha", "a.pdf", 50, "application/pdf", "parse", None)
    store.put_content("alpha", honest.id, b"a" * 50)
    assert honest.expires_at == 1600  # its bytes came: the whole lifetime
    now[0] += 61  # mallory's declarations have expired; alpha's upload has not
    assert store.get_upload("alpha", honest.id).data == b"a" * 50
    sent = [store.create_upload("mallory", "x.pdf", 50, "application/pdf", "parse", None) for _ in range(4)]
    store.put_content("mallory", sent[0].id, b"m" * 50)  # mallory's byte quota: 50
    with pytest.raises(ApiError) as info:
        store.put_content("mallory", sent[1].id, b"m" * 50)
    assert info.value.code == "upload_quota_exceeded"
    assert store.held_bytes("mallory") == 50 and store.held_bytes() == 100


def test_metric_labels_name_the_mineru_routes():
    assert route_label("/v1/parse/jobs/abc") == "/v1/parse/jobs/{job_id}"
    assert route_label("/v1/uploads/upload_1/content") == "/v1/uploads/{upload_id}/{step}"
    assert route_label("/v1/files/file-zip.abc/content") == "/v1/files/{file_id}/content"
    assert route_label("/v1/tasks/abc/result") == "/v1/tasks/{task_id}/result"
    assert route_label("/v1/file_parse") == "/v1/file_parse" and route_label("/v1/uploads/a/b/c") == "other"


# -- the real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("mineru-api")
    keys = work / "keys.txt"
    keys.write_text(f"alpha:{ALPHA}\nbeta:{BETA}\n")
    traces = work / "traces"
    traces.mkdir()
    sample_trace(PAGES).save(traces / f"{REPLAYED}.json")
    args = [
        "--api-key-file",
        str(keys),
        "--workers",
        "1",
        "--max-upload-mb",
        str(MAX_UPLOAD_MB),
        "--allow-replay",
        "--replay",
        str(traces),
        "--max-new-tokens",
        BOUNDS,
        "--page-window",
        "1",
        "--result-ttl",
        "300",
    ]
    with running_server(tiny_model, work, *args) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ALPHA}"}, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def document() -> bytes:
    return pdf_bytes(PAGES)


@pytest.fixture(scope="module")
def native(server, document) -> dict:
    """What ``/v1/document/parse`` answers for the document replayed with the same trace."""
    trace = json.dumps(sample_trace(PAGES).to_dict()).encode()
    files = {"file": ("any.pdf", document), "replay": ("trace.json", trace, "application/json")}
    data = {"formats": "markdown,middle_json,structured_content"}
    response = httpx.post(
        f"{server.url}/v1/document/parse", files=files, data=data, headers={"X-API-Key": ALPHA}, timeout=300
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "success"
    return response.json()


def upload(client, data: bytes, name: str = f"{REPLAYED}.pdf") -> str:
    """MinerU's upload steps; returns the file id."""
    declared = {
        "filename": name,
        "bytes": len(data),
        "mime_type": "application/pdf",
        "purpose": "parse",
        "sha256sum": hashlib.sha256(data).hexdigest(),
    }
    created = client.post("/v1/uploads", json=declared)
    assert created.status_code == 200, created.text
    body = created.json()
    if body["status"] == "completed":  # these bytes are held already
        return body["file"]["id"]
    assert body["upload_method"] == "PUT" and body["upload_url"].endswith(f"/v1/uploads/{body['id']}/content")
    put = client.put(body["upload_url"], content=data, headers=body["upload_headers"])
    assert put.status_code == 200, put.text
    completed = client.post(f"/v1/uploads/{body['id']}/complete")
    assert completed.status_code == 200, completed.text
    done = completed.json()
    assert done["status"] == "completed" and done["file"]["bytes"] == len(data)
    assert done["file"]["sha256sum"] == declared["sha256sum"] and done["file"]["filename"] == name
    return done["file"]["id"]


def put_declaring(server, upload_id: str, size: int) -> bytes:
    """The head of the answer to a ``PUT`` of an upload's bytes declaring ``size`` bytes (none sent)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            f"PUT /v1/uploads/{upload_id}/content HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {ALPHA}\r\n"
            f"Content-Type: application/pdf\r\nContent-Length: {size}\r\n\r\n"
        )
        sock.sendall(head.encode())
        reply = read_response_head(sock)
    return reply


def poll(client, url: str, timeout: float = 240) -> tuple[dict, list[str]]:
    """Poll a job or task until it ends (bounded); returns its last state and the statuses seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.get(url)
        assert state.status_code == 200, state.text
        body = state.json()
        if not seen or seen[-1] != body["status"]:
            seen.append(body["status"])
        if body["status"] not in ("queued", "running"):
            return body, seen
        time.sleep(0.1)
    raise AssertionError(f"{url} did not finish in {timeout} s: {seen}")


def test_health_advertises_the_sources_and_outputs_served(server, client):
    health = client.get("/v1/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["version"]
    assert body["features"] == {
        "webhook": False,
        "output_formats": ["markdown", "middle_json", "structured_content", "zip"],
        "sources": ["file_id", "inline"],  # no "local": MinerU's client uploads
    }
    assert_error(httpx.get(f"{server.url}/v1/health"), 401, "missing_api_key")
    assert_error(
        httpx.get(f"{server.url}/v1/health", headers={"Authorization": "Bearer wrong-key-123"}), 401, "invalid_api_key"
    )


def test_upload_then_parse_job_gives_the_native_outputs(server, client, document, native):
    file_id = upload(client, document)
    assert upload(client, document) == file_id  # declared again with its digest: answered with the file at once
    assert client.get(f"/v1/files/{file_id}").json()["purpose"] == "parse"
    asked = ["markdown", "middle_json", "structured_content", "zip"]
    submitted = client.post(
        "/v1/parse/jobs", json={"files": [{"source": {"type": "file_id", "file_id": file_id}}], "output_formats": asked}
    )
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert job["status"] in ("queued", "running") and job["output_formats"] == asked
    assert job["tier"] == "advanced" and job["access_level"] == "registered"
    assert job["links"] == {"self": f"/v1/parse/jobs/{job['job_id']}", "cancel": f"/v1/parse/jobs/{job['job_id']}"}
    (entry,) = job["files"]
    assert entry["file_id"] == file_id and entry["name"] == f"{REPLAYED}.pdf" and entry["output_files"] is None

    state, seen = poll(client, f"/v1/parse/jobs/{job['job_id']}")
    assert seen[-1] == "completed" and set(seen) <= {"queued", "running", "completed"}
    assert seen == sorted(seen, key=["queued", "running", "completed"].index)  # forward only
    assert state["progress"] == {"completed": 1, "failed": 0, "total": 1}
    assert state["started_at"] and state["finished_at"] >= state["started_at"] >= state["created_at"]
    (entry,) = state["files"]
    assert entry["status"] == "completed" and entry["page_range"] == f"1-{PAGES}" and entry["error"] is None
    assert entry["parse"]["duration_ms"] >= 0 and entry["parse"]["parser_version"].startswith("mineru-fast")
    outputs = entry["output_files"]
    assert {k for k, v in outputs.items() if v} == set(asked) and outputs["html"] is None

    def content(fmt: str) -> bytes:
        response = client.get(f"/v1/files/{outputs[fmt]['file_id']}/content")
        assert response.status_code == 200, response.text
        assert len(response.content) == outputs[fmt]["bytes"]
        return response.content

    markdown = content("markdown").decode("utf-8")
    assert markdown == native["markdown"] and "A replayed paragraph of body text." in markdown
    middle = json.loads(content("middle_json"))
    assert middle["schema"] == "docvortex.middle" and middle["pages"] == native["middle_json"]["pages"]
    assert json.loads(content("structured_content"))["pages"] == native["structured_content"]["pages"]
    with zipfile.ZipFile(io.BytesIO(content("zip"))) as archive:
        names = sorted(archive.namelist())
        assert names == sorted(
            [
                "markdown.md",
                "middle_json.json",
                "structured_content.json",
                "model_output.json",
                *(f"images/page_{i}_image_2.jpg" for i in range(PAGES)),
            ]
        )
        assert archive.read("markdown.md").decode("utf-8") == markdown
        assert json.loads(archive.read("middle_json.json")) == middle
    described = client.get(f"/v1/files/{outputs['zip']['file_id']}").json()
    assert described["purpose"] == "parse_output" and described["filename"] == f"{REPLAYED}.pdf.zip"
    assert client.get(f"/v1/jobs/{job['job_id']}").json()["status"] == "done"  # one of the service's jobs

    # Another key sees none of it.
    with httpx.Client(base_url=server.url, headers={"X-API-Key": BETA}, timeout=30) as beta:
        assert_error(beta.get(f"/v1/parse/jobs/{job['job_id']}"), 404, "job_not_found")
        assert_error(beta.get(f"/v1/files/{outputs['markdown']['file_id']}/content"), 404, "file_not_found")
        assert_error(beta.get(f"/v1/files/{file_id}"), 404, "file_not_found")
    assert_error(client.get(f"/v1/files/{file_id}/content"), 403, "source_not_downloadable")
    assert client.delete(f"/v1/files/{file_id}").json() == {"id": file_id, "object": "file", "deleted": True}
    assert_error(client.get(f"/v1/files/{file_id}"), 404, "file_not_found")


def test_a_task_counting_pages_from_the_end(server, client, document):
    """``/v1/tasks`` with a multipart upload and MinerU's ``rN`` page range: the last page only,
    equal to the native parse of that page."""
    files = {"files": (f"{REPLAYED}.pdf", document, "application/pdf")}
    submitted = client.post("/v1/tasks", files=files, params={"page_range": "r1", "output_formats": ["markdown"]})
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()
    assert task["status_url"] == f"/v1/tasks/{task['task_id']}" and task["result_url"] == f"{task['status_url']}/result"
    assert "job_id" not in task and task["files"][0]["page_range"] == "r1"
    early = client.get(task["result_url"])
    assert early.status_code in (200, 202) and early.json()["task_id"] == task["task_id"]
    state, _ = poll(client, task["status_url"])
    assert state["status"] == "completed" and state["files"][0]["page_range"] == str(PAGES)
    result = client.get(task["result_url"])
    assert result.status_code == 200
    (entry,) = result.json()["files"]
    trace = json.dumps(sample_trace(PAGES).to_dict()).encode()
    single = client.post(
        "/v1/document/parse",
        files={"file": ("x.pdf", document), "replay": ("t.json", trace)},
        data={"pages": str(PAGES)},
    )
    assert entry["content"] == {"markdown": single.json()["markdown"]} and entry["content"]["markdown"]
    assert_error(client.get(task["result_url"], params={"response_format": "zip"}), 400, "unsupported_output_format")


def test_file_parse_answers_the_outputs_inline_or_as_the_zip(server, client, document, native):
    files = {"files": (f"{REPLAYED}.pdf", document, "application/pdf")}
    params = {"output_formats": ["markdown", "middle_json"]}
    answered = client.post("/v1/file_parse", files=files, params=params)
    assert answered.status_code == 200, answered.text
    body = answered.json()
    assert body["status"] == "completed" and body["output_formats"] == ["markdown", "middle_json"]
    (entry,) = body["files"]
    assert entry["content"]["markdown"] == native["markdown"]
    assert entry["content"]["middle_json"]["pages"] == native["middle_json"]["pages"]

    inline = {"type": "inline", "name": f"{REPLAYED}.pdf", "data": base64.b64encode(document).decode()}
    zipped = client.post("/v1/file_parse", params={"response_format": "zip"}, json={"files": [{"source": inline}]})
    assert zipped.status_code == 200, zipped.text
    assert zipped.headers["content-type"] == "application/zip"
    assert zipped.headers["x-mineru-task-status"] == "completed" and zipped.headers["x-mineru-task-id"]
    with zipfile.ZipFile(io.BytesIO(zipped.content)) as archive:
        assert archive.read("markdown.md").decode("utf-8") == native["markdown"]

    raw = client.post(
        "/v1/file_parse",
        content=document,
        params={"filename": f"{REPLAYED}.pdf"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert raw.status_code == 200, raw.text
    assert raw.json()["files"][0]["content"]["markdown"] == native["markdown"]


def test_bad_requests_get_clear_4xx_errors(server, client, document):
    def job(source: dict | None = None, **fields) -> httpx.Response:
        source = source or {"type": "inline", "name": "a.pdf", "data": base64.b64encode(document).decode()}
        return client.post("/v1/parse/jobs", json={"files": [{"source": source}], **fields})

    # Options mineru-fast cannot honour: 400, naming what is served.
    assert "not built" in assert_error(job(tier="flash"), 400, "tier_unavailable")["message"]
    assert "'advanced'" in assert_error(job(tier="standard"), 400, "tier_unavailable")["message"]
    assert "'auto'" in assert_error(job(ocr_mode="txt"), 400, "ocr_mode_unavailable")["message"]
    assert (
        "'html'" in assert_error(job(output_formats=["markdown", "html"]), 400, "unsupported_output_format")["message"]
    )
    assert_error(job(output_formats=[]), 400, "unsupported_output_format")
    assert_error(job(callback={"url": "https://example.com/hook"}), 400, "callback_unsupported")
    assert_error(job({"type": "url", "url": "https://example.com/a.pdf"}), 400, "unsupported_source")
    assert_error(job({"type": "local", "path": "/etc/passwd"}), 400, "unsupported_source")
    two = {"type": "inline", "name": "a.pdf", "data": base64.b64encode(document).decode()}
    two_files = client.post("/v1/parse/jobs", json={"files": [{"source": two}, {"source": two}]})
    assert_error(two_files, 400, "too_many_files")
    # Values outside MinerU's own models, and broken documents: the service's 422s.
    assert "tier" in assert_error(job(tier="xhigh"), 422, "invalid_request")["message"]
    assert_error(job(unknown_field=1), 422, "invalid_request")
    assert_error(client.post("/v1/parse/jobs", json={"files": []}), 422, "invalid_request")
    assert_error(job({"type": "inline", "name": "a.pdf", "data": "not base64!"}), 400, "invalid_request")
    assert_error(
        job({"type": "inline", "name": "a.pdf", "data": base64.b64encode(b"%PDF-1.4 broken").decode()}),
        422,
        "corrupt_document",
    )
    source = {"type": "inline", "name": "a.pdf", "data": base64.b64encode(document).decode()}
    reversed_range = client.post("/v1/parse/jobs", json={"files": [{"source": source, "page_range": "2-1"}]})
    assert_error(reversed_range, 422, "bad_page_range")
    assert_error(job({"type": "file_id", "file_id": "file-000000000000000000000000"}), 404, "file_not_found")

    # Missing file, bad bodies, unknown ids.
    assert_error(client.post("/v1/tasks", files={"other": ("a.pdf", document)}), 400, "invalid_request")
    assert_error(
        client.post("/v1/tasks", content=b"x", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"
    )
    assert_error(
        client.post("/v1/file_parse", content=document, headers={"Content-Type": "application/octet-stream"}),
        400,
        "invalid_request",
    )  # no filename
    assert_error(
        client.post(
            "/v1/file_parse",
            content=b"",
            params={"filename": "a.pdf"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
        "empty_file",
    )
    assert_error(
        client.post("/v1/tasks", files={"files": ("a.pdf", document)}, params={"tier": "basic"}),
        400,
        "tier_unavailable",
    )
    assert_error(
        client.post("/v1/tasks", files={"files": ("a.pdf", document)}, params={"bogus": "1"}), 422, "invalid_request"
    )
    assert_error(
        client.post("/v1/file_parse", params={"wait_timeout": 0}, files={"files": ("a.pdf", document)}),
        422,
        "invalid_request",
    )
    assert_error(client.get("/v1/tasks/nope"), 404, "job_not_found")
    assert_error(client.get("/v1/tasks/nope/result"), 404, "job_not_found")
    assert_error(client.get("/v1/parse/jobs/nope"), 404, "job_not_found")
    assert_error(client.get("/v1/uploads/upload_nope"), 404, "upload_not_found")
    assert_error(client.get("/v1/files/file-zip.nope/content"), 404, "file_not_found")
    assert_error(client.delete("/v1/parse/jobs/nope"), 405, "cancel_unsupported")

    # Upload steps out of order or over the limits.
    too_big = {"filename": "a.pdf", "bytes": MAX_UPLOAD_MB * 2**20 + 1, "mime_type": "application/pdf"}
    assert (
        f"{MAX_UPLOAD_MB} MiB"
        in assert_error(client.post("/v1/uploads", json=too_big), 413, "payload_too_large")["message"]
    )
    declared = client.post("/v1/uploads", json={"filename": "a.pdf", "bytes": 10, "mime_type": "application/pdf"})
    upload_id = declared.json()["id"]
    assert_error(client.post(f"/v1/uploads/{upload_id}/complete"), 409, "upload_not_ready")
    assert_error(client.put(f"/v1/uploads/{upload_id}/content", content=b"short"), 400, "upload_size_mismatch")
    assert put_declaring(server, upload_id, 2 * MAX_UPLOAD_MB * 2**20).startswith(
        b"HTTP/1.1 413"
    )  # the service's limit
    assert client.post(f"/v1/uploads/{upload_id}/cancel").json()["status"] == "cancelled"
    assert_error(client.put(f"/v1/uploads/{upload_id}/content", content=b"0123456789"), 409, "upload_already_terminal")
    assert_error(
        client.post("/v1/uploads", json={"filename": "a.pdf", "bytes": 0, "mime_type": "x"}), 422, "invalid_request"
    )


def test_declarations_without_bytes_leave_the_store_to_other_keys(server, client, document):
    """Audit round 4, N1 (bounded attack, loopback): one key declares 41 full-size uploads and
    sends no byte; another key's upload then goes through at once (on 44d1b50 it got
    ``429 upload_store_full`` for the records' whole lifetime). N7: a ``PUT`` whose
    ``Content-Length`` is not the declared size is refused before its body is read."""
    declared = {"filename": "x.pdf", "bytes": MAX_UPLOAD_MB * 2**20, "mime_type": "application/pdf"}
    answers = [client.post("/v1/uploads", json=declared) for _ in range(41)]
    assert [a.status_code for a in answers] == [200] * 41
    assert all(a.json()["expires_at"] - a.json()["created_at"] <= 60 for a in answers)  # brief until bytes come
    with httpx.Client(base_url=server.url, headers={"X-API-Key": BETA}, timeout=60) as beta:
        assert beta.get(f"/v1/files/{upload(beta, document)}").json()["bytes"] == len(document)
    small = client.post("/v1/uploads", json={"filename": "a.pdf", "bytes": 10, "mime_type": "application/pdf"})
    assert put_declaring(server, small.json()["id"], 20).startswith(b"HTTP/1.1 400")  # no body sent: not waited for
    for answer in answers:
        client.post(f"/v1/uploads/{answer.json()['id']}/cancel")


def test_mineru_routes_are_counted_by_route_template(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    lines = [line for line in response.text.splitlines() if line.startswith("mineru_fast_requests_total{")]
    assert any('route="/v1/parse/jobs/{job_id}"' in line and 'status="200"' in line for line in lines)
    assert any('route="/v1/uploads/{upload_id}/{step}"' in line for line in lines)
    assert not any("nope" in line for line in lines)  # ids never become labels


def test_shown_file_names_drop_paths_control_characters_and_excess():
    from mineru_fast.serve.mineru_api import shown_name

    assert (
        shown_name("report.pdf") == "report.pdf"
        and shown_name("Bericht über 2024 (v2).pdf") == "Bericht über 2024 (v2).pdf"
    )
    assert shown_name("../../etc/passwd") == "passwd" and shown_name("C:\\Users\\me\\scan.png") == "scan.png"
    assert shown_name("a\x1b[2Jb\r\n.pdf") == "a\ufffd[2Jb\ufffd\ufffd.pdf"  # no terminal escape, no line break
    assert shown_name("invoice\u202efdp.exe") == "invoice\ufffdfdp.exe"  # no right-to-left override
    for nothing in ("..", ".", "dir/", " ", "a/.."):
        assert shown_name(nothing) == "document", nothing
    long = shown_name("x" * 5000 + ".pdf")
    assert len(long) == 200 and long.endswith("x….pdf")
    assert shown_name("y" * 300) == "y" * 199 + "…"


def test_task_file_names_are_answered_without_their_path(client, document):
    """Uploaded file names were echoed raw in the task's ``files[0].name`` (and its outputs'
    ``filename``): path parts a client would save under, control characters, any length."""
    raw = client.post(
        "/v1/tasks",
        content=document,
        params={"filename": f"../../etc/\x1b[2J/{REPLAYED}.pdf"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert raw.status_code == 202, raw.text
    assert raw.json()["files"][0]["name"] == f"{REPLAYED}.pdf"
    multipart = client.post("/v1/tasks", files={"files": (f"../uploads/{REPLAYED}.pdf", document, "application/pdf")})
    assert multipart.status_code == 202, multipart.text
    assert multipart.json()["files"][0]["name"] == f"{REPLAYED}.pdf"
    for task in (raw.json(), multipart.json()):
        state, _ = poll(client, task["status_url"])  # replayed: the stem still names the trace
        assert state["status"] == "completed"


def body_bytes_in_flight(server) -> float | None:
    """The server's ``mineru_fast_request_body_bytes_in_flight`` gauge (None when it has none)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("mineru_fast_request_body_bytes_in_flight ")
    ]
    return values[0] if values else None


def test_request_bodies_in_flight_stay_within_each_keys_share(server, client, document):
    """Audit round 4, N7 (bounded attack, loopback): bodies were read whole before anything counted
    them (100 concurrent 50 MiB bodies: 587 MB -> 5,185 MB of server memory). Alpha streams two
    full-size bodies slowly, a raw ``/v1/tasks`` and a multipart ``/v1/document/parse``: they hold
    6 MiB of its share (a quarter of 3 MiB x (1 worker + 8 queued) = 6.75 MiB). Alpha's third is
    answered 429 from its headers, no byte of its body sent; beta's parse is served meanwhile; the
    bytes are given back when the clients leave."""
    import threading

    def gauge_reaches(value: int) -> bool:
        deadline = time.monotonic() + 60  # a bound on a hang
        while body_bytes_in_flight(server) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return body_bytes_in_flight(server) == value

    size = MAX_UPLOAD_MB * 2**20
    port = int(server.url.rsplit(":", 1)[1])
    part = '--b\r\nContent-Disposition: form-data; name="file"; filename="slow.pdf"\r\n\r\n'
    requests = [  # (request line and content type, start of the body)
        ("POST /v1/tasks?filename=slow.pdf HTTP/1.1\r\nContent-Type: application/octet-stream", "%PDF-1.4\n"),
        ("POST /v1/document/parse HTTP/1.1\r\nContent-Type: multipart/form-data; boundary=b", part),
    ]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:  # 10 KiB/s: above --min-body-rate, no pause near --body-timeout
        while not stop.wait(0.1):
            try:
                sock.sendall(b"x" * 1024)
            except OSError:
                return

    attackers = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in requests]
    threads = []
    try:
        for sock, (head, start) in zip(attackers, requests, strict=True):
            sock.sendall(
                f"{head}\r\nHost: 127.0.0.1\r\nX-API-Key: {ALPHA}\r\nContent-Length: {size}\r\n\r\n{start}".encode()
            )
            threads.append(threading.Thread(target=trickle, args=(sock,), daemon=True))
            threads[-1].start()
        assert gauge_reaches(2 * size)  # reserved from the headers, before the bytes

        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(
                f"POST /v1/file_parse?filename=third.pdf HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {ALPHA}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n".encode()
            )
            reply = read_response_head(sock)  # no body sent: answered without waiting for it
        assert reply.startswith(b"HTTP/1.1 429") and b"retry-after: 1\r\n" in reply.lower(), reply[:300]
        assert client.get("/v1/health").status_code == 200  # a request without a body still goes through

        answered = httpx.post(
            f"{server.url}/v1/file_parse",
            content=document,
            params={"filename": f"{REPLAYED}.pdf"},
            headers={"X-API-Key": BETA, "Content-Type": "application/octet-stream"},
            timeout=300,
        )
        assert answered.status_code == 200, answered.text
        assert answered.json()["files"][0]["content"]["markdown"]
        assert body_bytes_in_flight(server) == 2 * size  # beta's body given back, alpha's still held
    finally:
        stop.set()
        for sock in attackers:
            sock.close()
        for thread in threads:
            thread.join(10)
    assert gauge_reaches(0)


def test_declared_and_inline_file_names_are_kept_as_shown_names(client, document):
    """The names of ``POST /v1/uploads`` and of inline sources were kept and echoed raw too."""
    declared = {"filename": "../../x/\x1b[2Jscan.pdf", "bytes": 10, "mime_type": "application/pdf"}
    created = client.post("/v1/uploads", json=declared)
    assert created.status_code == 200 and created.json()["filename"] == "\ufffd[2Jscan.pdf"
    client.post(f"/v1/uploads/{created.json()['id']}/cancel")
    inline = {"type": "inline", "data": base64.b64encode(document).decode(), "name": f"../../{REPLAYED}.pdf"}
    submitted = client.post("/v1/parse/jobs", json={"files": [{"source": inline}], "output_formats": ["markdown"]})
    assert submitted.status_code == 202, submitted.text
    assert submitted.json()["files"][0]["name"] == f"{REPLAYED}.pdf"
    # Waited for and read: a job left unread holds the server's graceful drain until its timeout.
    state, _ = poll(client, f"/v1/parse/jobs/{submitted.json()['job_id']}")
    assert state["status"] == "completed" and state["files"][0]["name"] == f"{REPLAYED}.pdf"
