"""The HTTP service against hostile clients and operators: admission by cost, slow clients, the
connection cap, Host/Origin checks, signals at any moment.

Parts in process first, then real ``mineru-fast serve`` processes (tiny model, 127.0.0.1 only).
Every loop is bounded in count and time; no assertion depends on how fast this machine is (the
deadlines below are timeouts meant to be reached, or generous bounds on a hang).
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from samples import blank_png, image_bytes, pdf_bytes, text_page
from serve_helpers import BOUNDS, free_port, running_server, start_server, wait_for, wait_ready

from mineru_fast.serve.jobs import Job, JobManager, OverBudget, QueueFull, ShuttingDown
from mineru_fast.serve.parsing import decode_cost
from mineru_fast.serve.store import MemoryJobStore

# -- parts, in process -----------------------------------------------------------------------------


def test_decode_cost_is_the_largest_peak_plus_the_rest_of_a_window():
    assert decode_cost([], 4) == 0
    assert decode_cost([(30, 15)], 4) == 30  # one page: the window holds only it
    assert decode_cost([(30, 15)] * 10, 4) == 30 + 3 * 15
    assert decode_cost([(1000, 49), (30, 15)], 2) == 1000 + 49  # the largest peak, the largest kept page


def test_page_costs_count_the_measured_bytes_of_each_source_from_headers_only():
    """The budget counted 1 per pixel (its README: 4-8 bytes); an RGBA frame really takes ~24
    bytes per pixel while it is decoded, converted, composited on white and made RGB."""
    from PIL import Image

    from mineru_fast.inputs.documents import open_document

    kept_3500 = 3500 * 3500 * 4  # a frame over the 3500-pixel long side is kept downscaled, as RGB
    with open_document(blank_png(12000, 12000), decode_first=False) as opened:  # 0.6 MB of file
        assert opened.page_cost(0) == (12000 * 12000 * 24 + kept_3500, kept_3500)
    with open_document(image_bytes(Image.new("RGB", (400, 300)), "PNG"), decode_first=False) as opened:
        assert opened.page_cost(0) == (400 * 300 * 12, 400 * 300 * 4)
    with open_document(image_bytes(Image.new("L", (400, 300)), "PNG"), decode_first=False) as opened:
        assert opened.page_cost(0) == (400 * 300 * 12, 400 * 300 * 4)
    with open_document(image_bytes(Image.new("I;16", (400, 300)), "PNG"), decode_first=False) as opened:
        assert opened.page_cost(0)[0] == 400 * 300 * 31
    with open_document(pdf_bytes(1), decode_first=False) as opened:
        width, height = opened.page_size(0)
        assert opened.page_cost(0) == (width * height * 8, width * height * 4)
    with open_document(pdf_bytes(1), decode_first=False, render_timeout=60) as opened:  # + a render process
        assert opened.page_cost(0) == (width * height * 17, width * height * 4)


def test_a_chat_image_holds_its_decode_cost_then_its_kept_image_until_released(monkeypatch):
    from PIL import Image, ImageFile

    from mineru_fast.serve.chat import ChatImageDecoder
    from mineru_fast.serve.errors import ApiError
    from mineru_fast.serve.jobs import CostBudget

    decoded = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or load(self))
    budget = CostBudget(400 * 300 * 12)  # one 400x300 RGB image's peak exactly
    seen = []
    monkeypatch.setattr(budget, "release", lambda cost, release=budget.release: seen.append(cost) or release(cost))
    decoder = ChatImageDecoder(budget, max_pixels=10**8)
    image = decoder(image_bytes(Image.new("RGB", (400, 300)), "PNG"))
    assert image.size == (400, 300) and budget.used == 400 * 300 * 4  # the kept RGB image
    assert seen == [400 * 300 * 8]  # the decode's extra given back once decoded
    other = ChatImageDecoder(budget, max_pixels=10**8)
    with pytest.raises(ApiError) as busy:
        other(image_bytes(Image.new("RGB", (400, 300)), "PNG"))
    assert (busy.value.status, busy.value.code, busy.value.headers) == (429, "over_capacity", {"Retry-After": "1"})
    decoder.release()
    decoder.release()  # idempotent
    assert budget.used == 0
    decoded.clear()
    with pytest.raises(ApiError) as large:
        other(image_bytes(Image.new("RGB", (401, 300)), "PNG"))
    assert (large.value.status, large.value.code) == (413, "image_too_large") and decoded == []  # never decoded
    other.release()
    assert budget.used == 0


def test_job_manager_admits_by_cost_and_keeps_only_retained_jobs():
    gate = threading.Event()

    def runner(job: Job) -> dict:
        assert gate.wait(10)
        return {"n": job.payload}

    store = MemoryJobStore(result_ttl=60)
    manager = JobManager([runner], max_queued=5, store=store, max_cost=100)
    manager.start()
    try:
        first = manager.submit(Job(1, cost=60))
        with pytest.raises(OverBudget) as info:
            manager.submit(Job(2, cost=41))
        assert isinstance(info.value, QueueFull) and info.value.retry_after >= 1
        sync = manager.submit(Job(3, cost=40, retain=False))
        assert manager.cost == 100
        assert store.get(first.id, None).id == first.id and store.get(sync.id, None) is None  # never findable by id
        gate.set()
        assert wait_for(lambda: manager.cost == 0, 10)
        assert sync.result == {"n": 3} and store.get(sync.id, None) is None
    finally:
        gate.set()
        manager.shutdown(5)


def test_job_manager_drain_waits_until_jobs_are_done_and_collected():
    gate = threading.Event()
    store = MemoryJobStore(result_ttl=60)
    manager = JobManager([lambda job: gate.wait(10) and {}], max_queued=4, store=store)
    manager.start()
    try:
        gate.set()
        finished_earlier = manager.submit(Job("x"))  # finished before the drain: not waited for
        assert wait_for(lambda: finished_earlier.status == "done", 10)
        gate.clear()
        done_before = manager.submit(Job("a"))
        running = manager.submit(Job("b"))
        manager.stop_accepting()
        with pytest.raises(ShuttingDown):
            manager.submit(Job("late"))
        assert not manager.wait_drained(0.2)  # running and queued
        assert not store.get(finished_earlier.id, None).collected
        gate.set()
        assert wait_for(lambda: running.status == "done", 10)
        assert not manager.drained()  # finished, but nobody has fetched the results yet
        store.collect(done_before.id)
        assert not manager.drained()
        store.collect(running.id)
        assert manager.wait_drained(1)
    finally:
        gate.set()
        manager.shutdown(5)


def test_method_labels_and_host_names():
    from mineru_fast.serve.hosts import host_name
    from mineru_fast.serve.metrics import method_label

    assert [method_label(m) for m in ("GET", "POST", "OPTIONS", "get", "FOO", "X" * 100)] == [
        "GET",
        "POST",
        "OPTIONS",
        "other",
        "other",
        "other",
    ]
    assert host_name("127.0.0.1:8000") == "127.0.0.1" and host_name("LocalHost") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("example.org") == "example.org"
    for bad in ("", "a b", "evil.example@127.0.0.1", "127.0.0.1:port", "127.0.0.1/x"):
        assert host_name(bad) is None, bad


def test_host_allow_list_defaults():
    from mineru_fast.serve.config import ServeConfig

    assert ServeConfig().host_allow_list() == ("localhost", "127.0.0.1", "::1")
    assert ServeConfig(host="10.1.2.3").host_allow_list() == ("localhost", "127.0.0.1", "::1", "10.1.2.3")
    assert ServeConfig(host="0.0.0.0").host_allow_list() == ("*",)
    assert ServeConfig(api_key_file="keys.txt").host_allow_list() is None  # keys: no check by default
    assert ServeConfig(api_key_file="keys.txt", allowed_hosts=("Docs.Example",)).host_allow_list() == ("docs.example",)
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServeConfig(allowed_hosts=("http://example.org",))


def test_accept_error_lines_are_rate_limited():
    from mineru_fast.serve.connections import ACCEPT_ERROR_PREFIX, RateLimitedLogFilter

    now = [0.0]
    limiter = RateLimitedLogFilter(ACCEPT_ERROR_PREFIX, interval=10.0, clock=lambda: now[0])
    log = logging.getLogger("test.accept")

    def record(message: str) -> logging.LogRecord:
        return log.makeRecord(log.name, logging.ERROR, __file__, 1, message, None, (OSError, OSError(24), None))

    passed = []
    for second in range(30):  # 1,000 failures a second, as a process at its file limit logs them
        now[0] = float(second)
        for _ in range(1000):
            rec = record(f"{ACCEPT_ERROR_PREFIX}\nsocket: <socket>")
            if limiter.filter(rec):
                passed.append(rec)
    assert len(passed) == 3 and [r.suppressed for r in passed] == [0, 9999, 9999]
    assert all(r.exc_info is None for r in passed)  # the traceback is dropped
    assert limiter.filter(record("something else"))


def test_connection_cap_stays_below_the_open_file_limit(monkeypatch):
    import resource

    from mineru_fast.serve.connections import connection_limits

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (128, 4096))
    assert connection_limits(1000) == (48, 16) and connection_limits(10) == (10, 21)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert connection_limits(128) == (128, 216)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert connection_limits(1000) == (1000, 2048)


def test_body_budget_bounds_all_bodies_in_flight_and_each_keys_share():
    from mineru_fast.serve.security import BodyBudget, BodyRefused

    budget = BodyBudget(capacity=100, key_share=40)

    def refusal(key, size) -> tuple:
        with pytest.raises(BodyRefused) as info:
            budget.reserve(key, size)
        return info.value.status, info.value.code, info.value.headers

    budget.reserve("alpha", 30)
    assert refusal("alpha", 11) == (429, "upload_buffer_quota", {"Retry-After": "1"})  # 41 > its share of 40
    assert refusal("alpha", 41)[:2] == (413, "payload_too_large")  # more than it may ever hold
    budget.reserve("beta", 40)  # another key's share is its own
    budget.reserve(None, 30)  # requests without a key share only the whole
    assert budget.used == 100
    assert refusal(None, 1) == (503, "upload_buffer_full", {"Retry-After": "1"})
    assert refusal("gamma", 1)[0] == 503
    assert refusal(None, 101)[:2] == (413, "payload_too_large")
    assert budget.used == 100  # a refusal reserves nothing
    budget.release("alpha", 30)
    budget.reserve("alpha", 10)
    budget.release("alpha", 10)
    budget.release("beta", 40)
    budget.release(None, 30)
    assert budget.used == 0
    budget.reserve("alpha", 40)  # its whole share again: nothing of the earlier reservations is left
    budget.release("alpha", 40)


def test_guard_refuses_a_body_over_the_budget_before_reading_it():
    """Audit round 4, N7: bodies were read whole before anything counted them (100 PUTs of 50 MiB
    at once took the server from 587 MB to 5,185 MB). A request whose declared body would pass the
    budget of bodies in flight is answered 503 before a byte of it is read; a body without a
    Content-Length is counted chunk by chunk and cut off (503) at the chunk that would pass it."""
    import asyncio

    from mineru_fast.serve.security import BodyBudget, GuardMiddleware, KeyRing, RateLimiter

    budget = BodyBudget(capacity=100, key_share=100)
    holding, release = asyncio.Event(), asyncio.Event()
    read: dict[str, bytes] = {}

    async def app(scope, receive, send):  # reads the whole body, then holds it until released
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        read[scope["path"]] = body
        if scope["path"] == "/v1/holder":
            holding.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = GuardMiddleware(
        app, KeyRing([]), RateLimiter(0, 1), max_body=1000, body_timeout=5, min_body_rate=1, budget=budget
    )

    async def request(path: str, chunks: list[bytes], declared: int | None) -> tuple[list[dict], int]:
        """The messages answered and how many chunks the application took."""
        headers = [] if declared is None else [(b"content-length", str(declared).encode())]
        scope = {"type": "http", "path": path, "method": "POST", "headers": headers, "state": {}}
        taken = 0
        answered: list[dict] = []

        async def receive():
            nonlocal taken
            taken += 1
            return {"type": "http.request", "body": chunks[taken - 1], "more_body": taken < len(chunks)}

        async def send(message):
            answered.append(message)

        await guard(scope, receive, send)
        return answered, taken

    def head(answered: list[dict]) -> tuple[int, dict]:
        return answered[0]["status"], {k.decode(): v.decode() for k, v in answered[0]["headers"]}

    async def scenario() -> None:
        holder = asyncio.create_task(request("/v1/holder", [b"h" * 60], 60))
        await asyncio.wait_for(holding.wait(), 10)
        assert budget.used == 60
        answered, taken = await request("/v1/over", [b"x" * 50], 50)  # 60 + 50 > 100
        status, headers = head(answered)
        assert (status, taken) == (503, 0) and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert json.loads(answered[1]["body"])["error"]["code"] == "upload_buffer_full"
        answered, taken = await request("/v1/alone", [b"x" * 101], 101)  # over the budget alone
        assert (head(answered)[0], taken) == (413, 0)
        answered, taken = await request("/v1/streamed", [b"s" * 20] * 4, None)  # no Content-Length: 60 + 20 + 20 + 20
        status, headers = head(answered)
        assert (status, taken) == (503, 3) and headers["retry-after"] == "1" and "/v1/streamed" not in read
        assert budget.used == 60  # what the cut-off body reserved is given back
        answered, taken = await request("/v1/fits", [b"f" * 40], 40)
        assert (head(answered)[0], taken, read["/v1/fits"]) == (200, 1, b"f" * 40)
        release.set()
        answered, _ = await holder
        assert head(answered)[0] == 200 and read["/v1/holder"] == b"h" * 60
        assert budget.used == 0

    asyncio.run(scenario())


async def _plain_app(scope, receive, send) -> None:
    """An ASGI application answering every request ``200 ok`` (for the connection tests)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection; ``b"reset"`` when it resets it."""
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        return b"reset"
    return data


def test_connections_over_the_cap_get_a_503_not_a_reset():
    """Audit round 4, N13: 172 of 300 connections over --max-connections got a TCP reset, not the
    documented 503: the server closed each with its request unread, and the kernel resets such a
    connection, dropping the answer on the way. A refused connection now gets the 503 and the end
    of the stream, and what it sends is read and dropped until the client closes (bounded)."""
    import uvicorn

    from mineru_fast.serve.connections import guarded_protocol

    protocol = guarded_protocol(header_timeout=60, max_connections=4)
    port = free_port()
    config = uvicorn.Config(_plain_app, host="127.0.0.1", port=port, http=protocol, log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-cap-test", daemon=True)
    thread.start()
    held = []
    try:
        assert wait_for(lambda: server.started, 60)
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]  # the cap, idle
        assert wait_for(lambda: len(server.server_state.connections) == 4, 30)
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

        def refused(_: int) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(request)
                time.sleep(0.2)  # the answer waits unread while the server is done with the connection
                return _answer(sock)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(refused, range(40)))
        assert [r[:12] for r in replies] == [b"HTTP/1.1 503"] * 40, {r[:12] for r in replies}
        assert all(b"retry-after: 1\r\n" in r and b'"too_many_connections"' in r for r in replies)
        assert wait_for(lambda: not protocol._lingering, 30)  # each closed once its client closed

        with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:  # sends nothing, never closes
            assert _answer(silent).startswith(b"HTTP/1.1 503")  # the answer, then the end at once
            assert protocol._lingering
            assert wait_for(lambda: not protocol._lingering, 30)  # dropped after its linger (2 s)
        for sock in held:
            sock.close()
        assert wait_for(lambda: not server.server_state.connections, 30)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # refused ones held no slot
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _answer(sock).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
        server.should_exit = True
        thread.join(30)


# -- the service in this process -------------------------------------------------------------------

httpx = pytest.importorskip("httpx", reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")
for _module in ("fastapi", "uvicorn", "prometheus_client", "multipart"):
    pytest.importorskip(_module, reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")


@pytest.fixture(scope="module")
def app_server(tiny_model):
    """The application under uvicorn in a thread of this process (tiny model)."""
    import uvicorn

    from mineru_fast import ParserOptions
    from mineru_fast.cli.options import parse_max_new_tokens
    from mineru_fast.serve import ServeConfig, create_app

    options = ParserOptions.preset("exact", page_window=1, max_new_tokens=parse_max_new_tokens(BOUNDS))
    port = free_port()
    app = create_app(ServeConfig(model=str(tiny_model), options=options, port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: _ready(url), 180, interval=0.2), "the in-process server did not become ready"
    yield url
    server.should_exit = True
    thread.join(60)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_no_pixel_is_decoded_before_a_job_is_queued(app_server, monkeypatch):
    """The upload check decoded whole images in the request thread pool, before the queue was asked."""
    from PIL import ImageFile

    decoders = []
    load = ImageFile.ImageFile.load

    def recording_load(self):
        decoders.append(threading.current_thread().name)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    page = image_bytes(text_page(size=(400, 300)), "PNG")
    response = httpx.post(f"{app_server}/v1/jobs", files={"file": ("p.png", page)}, timeout=60)
    assert response.status_code == 202, response.text
    status_url = f"{app_server}{response.json()['status_url']}"
    assert wait_for(lambda: httpx.get(status_url, timeout=30).json()["status"] == "done", 120)
    assert decoders and all(name.startswith("parse-worker") for name in decoders), decoders


def test_health_answers_while_an_upload_is_inspected(app_server, monkeypatch):
    """The event loop never waits for a document check: /health answers while one is held."""
    import mineru_fast.serve.admission as admission  # where every door checks its uploads

    entered, release = threading.Event(), threading.Event()
    inspect = admission.inspect_document

    def held_inspection(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return inspect(*args, **kwargs)

    monkeypatch.setattr(admission, "inspect_document", held_inspection)
    upload = blank_png(3000, 3000)
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(httpx.post, f"{app_server}/v1/jobs", files={"file": ("big.png", upload)}, timeout=120)
        try:
            assert entered.wait(60)
            health = httpx.get(f"{app_server}/health", timeout=30)  # would hang if the check ran on the loop
            assert health.status_code == 200 and not submitted.done()
        finally:
            release.set()
        assert submitted.result().status_code == 202


def test_results_are_encoded_off_the_event_loop(app_server, monkeypatch):
    """Audit round 4: the event loop stalled up to 867 ms while a large result was encoded as JSON
    (every other request waited). Results are encoded in worker threads."""
    from fastapi.responses import JSONResponse

    encoded_in = []
    render = JSONResponse.render

    def recording_render(self, content):
        if not isinstance(content, dict):
            return render(self, content)
        if isinstance(content.get("pages"), list) or "content" in (content.get("files") or [{}])[0]:
            encoded_in.append(threading.current_thread().name)  # a result, not a status or an error
        return render(self, content)

    monkeypatch.setattr(JSONResponse, "render", recording_render)
    page = image_bytes(text_page(size=(400, 300)), "PNG")
    parsed = httpx.post(f"{app_server}/v1/document/parse", files={"file": ("p.png", page)}, timeout=300)
    assert parsed.status_code == 200 and parsed.json()["pages"], parsed.text
    job = httpx.post(f"{app_server}/v1/jobs", files={"file": ("p.png", page)}, timeout=60).json()
    assert wait_for(lambda: httpx.get(f"{app_server}{job['status_url']}", timeout=30).json()["status"] == "done", 300)
    assert httpx.get(f"{app_server}{job['result_url']}", timeout=60).json()["pages"]
    task = httpx.post(
        f"{app_server}/v1/file_parse",
        content=page,
        params={"filename": "p.png", "output_formats": ["markdown", "middle_json"]},
        headers={"Content-Type": "application/octet-stream"},
        timeout=300,
    )
    assert task.status_code == 200 and task.json()["files"][0]["content"]["middle_json"]["pages"], task.text
    assert len(encoded_in) == 3 and "uvicorn-test" not in encoded_in, encoded_in  # the event loop's thread


# -- a real server without API keys ----------------------------------------------------------------

OPEN_FILES = 128  # the server's file limit: its connection cap is clamped to (128 - 32) / 2 = 48


@pytest.fixture(scope="module")
def open_server(tiny_model, tmp_path_factory):
    args = [
        "--workers-queue",
        "2",
        "--decode-budget-mb",
        "1200",
        "--header-timeout",
        "20",  # long enough to hold the connections of the cap test open while they are counted
        "--body-timeout",
        "2",
        "--max-connections",
        "1000",
        "--max-new-tokens",
        BOUNDS,
        "--page-window",
        "1",
        "--drain-timeout",
        "5",
    ]
    with running_server(tiny_model, tmp_path_factory.mktemp("open"), *args, open_files=OPEN_FILES) as server:
        yield server


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` s pass)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {timeout} s; got {data[:200]!r}")


def _trickle(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Send ``data`` one byte every 0.5 s (well within any pause limit) until ``stop`` or an error."""
    for byte in data:
        if stop.wait(0.5):
            return
        try:
            sock.send(bytes([byte]))
        except OSError:
            return


@pytest.mark.slow
def test_slow_headers_and_stalled_bodies_are_cut_off(open_server):
    """Connections trickling a byte at a time stayed open indefinitely."""
    port = _port(open_server)
    body_head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    headers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    bodies = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    for sock in bodies:
        sock.sendall(body_head)  # complete headers, then a body of a byte every 0.5 s
    stop = threading.Event()
    slow_header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 500
    threads = [threading.Thread(target=_trickle, args=(s, slow_header, stop), daemon=True) for s in headers]
    threads += [threading.Thread(target=_trickle, args=(s, b"--b\r\n" + b"y" * 500, stop), daemon=True) for s in bodies]
    for t in threads:
        t.start()
    try:
        for sock in headers:
            reply = _read_until_closed(sock, timeout=90)  # --header-timeout 20
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:200]
        for sock in bodies:
            reply = _read_until_closed(sock, timeout=90)  # 2 s grace, then 1024 bytes/s
            assert reply.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in reply, reply[:200]
    finally:
        stop.set()
        for sock in headers + bodies:
            sock.close()

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (
            "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            "Content-Length: 100000\r\n\r\n--b\r\n"
        )
        sock.sendall(head.encode())  # then nothing: the body stalls
        reply = _read_until_closed(sock, timeout=90)  # --body-timeout 2
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"body_timeout"' in reply
    assert httpx.get(f"{open_server.url}/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_connections_are_capped_below_the_file_limit_without_accept_errors(open_server):
    """At the file limit every accept failed, /health timed out and the log grew by megabytes."""
    port = _port(open_server)
    sockets = []
    start = time.monotonic()
    try:
        for _ in range(2 * OPEN_FILES):  # more connections than the server has file descriptors
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        replies = [_read_until_closed(sock, timeout=90) for sock in sockets]  # refused, or cut at 20 s
    finally:
        for sock in sockets:
            sock.close()
    seconds = time.monotonic() - start
    busy = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
    assert busy and all(b'"too_many_connections"' in r for r in busy)
    assert all(r == b"" or r.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) for r in replies)
    assert httpx.get(f"{open_server.url}/health", timeout=30).status_code == 200
    lines = open_server.log_lines()
    assert not [line for line in lines if "out of system resource" in line]
    refused = [r for r in open_server.log_records() if r["message"].startswith("connection refused")]
    assert refused and refused[0]["limit"] == 48  # the cap, clamped below the file limit
    assert len(refused) <= 1 + seconds / 10  # one line per 10 s, however many were refused


@pytest.mark.slow
def test_foreign_hosts_and_origins_are_refused_without_api_keys(open_server):
    """Without keys any web page could post to the server, and DNS rebinding could read answers."""
    url = open_server.url
    same_origin = f"http://127.0.0.1:{_port(open_server)}"
    cases = [
        ({"Host": "evil.example"}, 403, "host_not_allowed"),
        ({"Host": f"evil.example:{_port(open_server)}"}, 403, "host_not_allowed"),
        ({"Origin": "http://evil.example"}, 403, "origin_not_allowed"),
        ({"Origin": "null"}, 403, "origin_not_allowed"),
        ({"Origin": same_origin}, 200, None),
        ({"Host": f"localhost:{_port(open_server)}"}, 200, None),
        ({}, 200, None),
    ]
    for headers, status, code in cases:
        response = httpx.get(f"{url}/health", headers=headers, timeout=30)
        assert response.status_code == status, (headers, response.text)
        if code:
            assert response.json()["error"]["code"] == code
    post = httpx.post(
        f"{url}/v1/jobs", headers={"Origin": "https://evil.example"}, files={"file": ("a.pdf", pdf_bytes(1))}
    )
    assert post.status_code == 403 and post.json()["error"]["code"] == "origin_not_allowed"


def _server_peak_rss(server) -> int:
    for line in open(f"/proc/{server.process.pid}/status", encoding="ascii"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _reset_server_peak_rss(server) -> None:
    try:
        with open(f"/proc/{server.process.pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    except OSError as exc:
        pytest.skip(f"cannot reset the server's peak RSS here: {exc}")


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    return blank_png(12000, 12000)  # 0.56 MB of file, 576 MB decoded (RGBA)


@pytest.mark.slow
def test_uploads_are_admitted_by_decoded_pixels_without_decoding_them(open_server, huge_png):
    """Each 12000x12000 upload cost ~0.5 GB of server memory before it was refused (4 at once +1.65 GB)."""
    url = open_server.url
    blocker = httpx.post(f"{url}/v1/jobs", files={"file": ("b.pdf", pdf_bytes(6))}, timeout=60)
    assert blocker.status_code == 202, blocker.text
    assert blocker.json()["pages"]["total"] == 6
    assert wait_for(lambda: httpx.get(f"{url}{blocker.json()['status_url']}").json()["status"] == "running", 60)

    _reset_server_peak_rss(open_server)
    before = _server_peak_rss(open_server)
    with ThreadPoolExecutor(4) as pool:
        burst = list(
            pool.map(
                lambda _: httpx.post(f"{url}/v1/jobs", files={"file": ("huge.png", huge_png)}, timeout=120), range(4)
            )
        )
    grown = _server_peak_rss(open_server) - before
    for response in burst:  # 144 megapixels of RGBA (~3.3 GiB while decoded) alone exceed --decode-budget-mb 1200
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "document_too_large"
        assert "needs 3,343 MiB of decoded pages" in response.json()["error"]["message"]
    assert grown < 100 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB"  # one decode alone is 549 MiB

    medium = blank_png(6000, 6000)  # 36 megapixels of RGBA, 871 MiB: fits the budget once, not twice
    first = httpx.post(f"{url}/v1/jobs", files={"file": ("m.png", medium)}, timeout=60)
    assert first.status_code == 202, first.text
    second = httpx.post(f"{url}/v1/jobs", files={"file": ("m.png", medium)}, timeout=60)
    assert second.status_code == 429 and second.json()["error"]["code"] == "over_capacity"
    assert 1 <= int(second.headers["retry-after"]) <= 120
    for job in (blocker.json(), first.json()):
        assert wait_for(lambda job=job: httpx.get(f"{url}{job['status_url']}").json()["status"] == "done", 300)
    again = httpx.post(f"{url}/v1/jobs", files={"file": ("m.png", medium)}, timeout=60)
    assert again.status_code == 202  # the budget is free again


def _idle(url: str) -> bool:
    """No job queued or running on the server (its gauges in ``/metrics``)."""
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    gauges = ("mineru_fast_queue_length ", "mineru_fast_jobs_in_flight ")
    return all(float(line.split()[-1]) == 0 for line in lines if line.startswith(gauges))


def jpeg_claiming(width: int, height: int) -> bytes:
    """A 16x16 baseline JPEG (well under 1 KB) whose frame header claims ``width`` x ``height``."""
    from PIL import Image

    data = bytearray(image_bytes(Image.new("RGB", (16, 16), "white"), "JPEG"))
    sof = data.index(b"\xff\xc0")  # SOF0: length (2), precision (1), height (2), width (2)
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def chat_body(image: bytes, media_type: str = "image/png") -> dict:
    url = f"data:{media_type};base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "\nText Recognition:"}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4}


@pytest.mark.slow
def test_chat_images_are_admitted_by_the_same_budget_before_they_are_decoded(open_server, huge_png):
    """A 560 KB PNG of 12000x12000 cost +3.2 GB per chat request and a 631-byte JPEG header
    claiming that size 1.7 GB: chat images had no budget, and up to 40 decoded at once."""
    url = open_server.url
    assert wait_for(lambda: _idle(url), 300)  # an earlier test's job would grow the server meanwhile
    tiny_header = jpeg_claiming(12000, 12000)
    assert len(tiny_header) < 1000
    _reset_server_peak_rss(open_server)
    before = _server_peak_rss(open_server)
    with ThreadPoolExecutor(4) as pool:
        bodies = [chat_body(huge_png)] * 3 + [chat_body(tiny_header, "image/jpeg")]
        burst = list(pool.map(lambda b: httpx.post(f"{url}/v1/chat/completions", json=b, timeout=120), bodies))
    grown = _server_peak_rss(open_server) - before
    for response in burst:
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "image_too_large"
    # RGBA: 24 bytes a pixel, + the kept copy (3,343 MiB), + the model's input for it (24 bytes a pixel of
    # at most 1,605,632: 37 MiB); RGB: 12 bytes a pixel (1,695 MiB), + the same input
    assert "needs 3,379 MiB" in burst[0].json()["error"]["message"]
    assert "needs 1,731 MiB" in burst[3].json()["error"]["message"]
    assert grown < 100 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB"

    blocker = httpx.post(f"{url}/v1/jobs", files={"file": ("b.pdf", pdf_bytes(6))}, timeout=60).json()
    assert wait_for(lambda: httpx.get(f"{url}{blocker['status_url']}").json()["status"] == "running", 300)
    medium = blank_png(6000, 6000)  # 871 MiB: the budget (1200) holds one
    queued = httpx.post(f"{url}/v1/jobs", files={"file": ("m.png", medium)}, timeout=60)
    assert queued.status_code == 202, queued.text
    busy = httpx.post(f"{url}/v1/chat/completions", json=chat_body(medium), timeout=120)
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "over_capacity", busy.text
    assert int(busy.headers["retry-after"]) >= 1
    for job in (blocker, queued.json()):
        assert wait_for(lambda job=job: httpx.get(f"{url}{job['status_url']}").json()["status"] == "done", 300)
    small = image_bytes(text_page(size=(400, 300)), "PNG")
    answered = httpx.post(f"{url}/v1/chat/completions", json=chat_body(small), timeout=300)
    assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_clients_that_stop_reading_large_results_are_cut_off_and_free_their_slots(tiny_model, tmp_path):
    """128 clients that never read a large result held every connection slot for good (no write
    timeout; /health answered 503 while they stayed) and +1.6 GB of buffered responses."""
    import json

    import numpy as np
    from PIL import Image
    from samples import sample_trace

    slots = 6
    args = ["--max-connections", str(slots), "--write-timeout", "3", "--max-response-buffer-mb", "1"]
    args += ["--allow-replay", "--max-new-tokens", BOUNDS, "--page-window", "1"]
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (1400, 1400, 3), dtype=np.uint8)) for _ in range(5)]
    # Each frame's layout overlay is ~2 MB of base64: a result the loopback's kernel buffers (~3 MB
    # a connection here) do not absorb.
    pages = image_bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:], compression="jpeg")
    trace = json.dumps(sample_trace(5).to_dict()).encode()
    with running_server(tiny_model, tmp_path, *args) as server:
        files = {"file": ("noise.tiff", pages), "replay": ("t.json", trace, "application/json")}
        job = httpx.post(f"{server.url}/v1/jobs", files=files, data={"formats": "layout"}, timeout=120).json()
        assert wait_for(lambda: httpx.get(f"{server.url}{job['status_url']}").json()["status"] == "done", 300)
        size = len(httpx.get(f"{server.url}{job['result_url']}", timeout=120).content)
        assert size > 9_000_000, size
        request = f"GET {job['result_url']} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        readers = []
        for _ in range(slots):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel absorbs little of it
            sock.connect(("127.0.0.1", _port(server)))
            sock.sendall(request)  # ... and never reads
            readers.append(sock)
        try:

            def health_ok() -> bool:
                try:
                    return httpx.get(f"{server.url}/health", timeout=10).status_code == 200
                except httpx.TransportError:
                    return False

            def cut(message: str) -> bool:
                return any(r["message"] == message for r in server.log_records())

            assert wait_for(lambda: cut("connection closed: unread responses over the buffer cap"), 120)
            assert wait_for(lambda: cut("connection closed: the client stopped reading its response"), 120)
            assert wait_for(health_ok, 120)  # every slot the readers held is free again
            for sock in readers:  # each was closed by the server: reading now ends, not hangs
                received = _read_until_closed(sock, 60)
                assert received.startswith(b"HTTP/1.1 200") and len(received) < size
        finally:
            for sock in readers:
                sock.close()


# -- signals at any moment -------------------------------------------------------------------------


@pytest.mark.parametrize("moment", ["loading model", "model loaded"])
def test_sigterm_while_the_model_loads_exits_cleanly(tiny_model, tmp_path, moment):
    """SIGTERM during start-up aborted with status 134 ("terminate called without an active exception")."""
    server = start_server(tiny_model, tmp_path)
    try:
        assert wait_for(lambda: any(r["message"] == moment for r in server.log_records()), 180, interval=0.02)
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert code == 0, server.log_lines()[-5:]
    assert "stopped" in [r["message"] for r in server.log_records()]


def test_sigterm_before_the_server_runs_exits_cleanly(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path)
    try:
        loading = lambda: any(r["message"] == "loading the application" for r in server.log_records())  # noqa: E731
        assert wait_for(loading, 120, interval=0.01)
        server.process.send_signal(signal.SIGTERM)  # while torch and the application are imported
        code = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert code == 0, server.log_lines()[-5:]
    messages = [r["message"] for r in server.log_records()]
    assert "stopped before start" in messages or "stopped" in messages
    with pytest.raises(RuntimeError):
        wait_ready(server, 1)


@pytest.mark.slow
def test_a_sync_parse_still_running_when_the_drain_runs_out_gets_a_json_503(tiny_model, tmp_path):
    """When --drain-timeout ran out, uvicorn cancelled the waiting request: a plain-text 500 and a
    traceback in the log."""
    args = ["--workers", "1", "--drain-timeout", "0", "--max-new-tokens", BOUNDS, "--page-window", "1"]
    server = start_server(tiny_model, tmp_path, *args)
    try:
        wait_ready(server, 180)
        blocker = httpx.post(f"{server.url}/v1/jobs", files={"file": ("b.pdf", pdf_bytes(30))}, timeout=120)
        assert blocker.status_code == 202, blocker.text
        answer: dict = {}

        def parse() -> None:
            response = httpx.post(
                f"{server.url}/v1/document/parse",
                headers={"X-Request-ID": "sync-at-drain"},
                files={"file": ("s.pdf", pdf_bytes(2))},
                timeout=300,
            )
            answer["status"], answer["type"], answer["text"] = (
                response.status_code,
                response.headers.get("content-type"),
                response.text,
            )

        thread = threading.Thread(target=parse)
        thread.start()
        queued = lambda: any(  # noqa: E731
            r["message"] == "job queued" and r.get("request_id") == "sync-at-drain" for r in server.log_records()
        )
        assert wait_for(queued, 120)
        server.process.send_signal(signal.SIGTERM)  # the sync job waits behind 30 pages: the drain (0 s) runs out
        thread.join(300)
        code = server.process.wait(timeout=300)
    finally:
        server.stop()
    assert answer["status"] == 503 and answer["type"] == "application/json", answer
    body = json.loads(answer["text"])
    assert body["error"]["code"] == "shutting_down" and body["error"]["request_id"] == "sync-at-drain"
    assert code == 0
    lines = server.log_lines()
    assert all(line.startswith("{") for line in lines), [line for line in lines if not line.startswith("{")][:5]
    assert "drain timed out" in [r["message"] for r in server.log_records()]
