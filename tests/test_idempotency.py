"""Idempotent job submission through the service (``Idempotency-Key`` on ``POST /v1/jobs``): a
repeat gets the job the first request made and the document is parsed once, a key reused for
another request is refused, keys are per API key, a malformed key is ``400``; and the client's
retry of a submission whose answer was lost gets the same job. The application runs in this
process (``httpx.ASGITransport``, tiny model); the store-level checks are in ``test_job_store``."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from samples import image_bytes, text_page

from mineru_fast.client import AsyncClient, RetryPolicy

for _module in ("fastapi", "uvicorn", "prometheus_client", "multipart"):
    pytest.importorskip(_module, reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")

KEYS = {"alpha": "alpha-secret-0001", "beta": "beta-secret-0002"}
# Random weights never emit a valid layout: a page is its bounded layout pass and nothing else.
BOUNDS = "layout=8,text=4,table=4,equation=4"
BASE_URL = "http://127.0.0.1"


@pytest.fixture(scope="module")
def app(tiny_model, tmp_path_factory):
    """The service's application with two API keys, loaded (tiny model, one worker)."""
    from mineru_fast import ParserOptions
    from mineru_fast.cli.options import parse_max_new_tokens
    from mineru_fast.serve import ServeConfig, create_app

    keys = tmp_path_factory.mktemp("idempotency") / "keys"
    keys.write_text("".join(f"{name}:{secret}\n" for name, secret in KEYS.items()))
    options = ParserOptions.preset("exact", threads=1, page_window=1, max_new_tokens=parse_max_new_tokens(BOUNDS))
    application = create_app(ServeConfig(model=str(tiny_model), options=options, api_key_file=keys, workers=1))
    service = application.state.service
    service.load()  # what the lifespan does in a thread; ASGITransport runs no lifespan
    assert service.state == "ready", service.load_error
    yield application
    service.shutdown()


@pytest.fixture
def parses(app, monkeypatch) -> list[int]:
    """The byte size of each document the service's workers parse from now on."""
    import mineru_fast.serve.service as service_module

    calls: list[int] = []
    parse = service_module.run_parse

    def counted(parser, request, progress=None):
        calls.append(len(request.data))
        return parse(parser, request, progress)

    monkeypatch.setattr(service_module, "run_parse", counted)
    return calls


def http(app, key: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL, headers=headers)


def upload(data: bytes) -> dict:
    return {"file": ("page.png", data, "application/octet-stream")}


def page(number: int) -> bytes:
    """A small PNG page, its width (and so its bytes) distinct per ``number``."""
    return image_bytes(text_page(size=(300 + 10 * number, 240), lines=4, seed=number), "PNG")


def settle(app, timeout: float = 120) -> None:
    """Wait until the service's workers have nothing queued or running."""
    jobs = app.state.service.jobs
    deadline = time.monotonic() + timeout
    while (jobs.queue_length or jobs.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (jobs.queue_length or jobs.in_flight)


async def finished(client: httpx.AsyncClient, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = (await client.get(f"/v1/jobs/{job_id}")).json()
        if status["status"] in ("done", "failed", "cancelled"):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_a_repeated_submission_gets_the_same_job_and_is_parsed_once(app, parses):
    document = page(1)
    key = {"Idempotency-Key": "order-1"}

    async def scenario() -> list[httpx.Response]:
        async with http(app, "alpha") as client:
            first = await client.post("/v1/jobs", files=upload(document), headers=key)
            again = await client.post("/v1/jobs", files=upload(document), headers=key)
            assert (await finished(client, first.json()["job_id"]))["status"] == "done"
            after = await client.post("/v1/jobs", files=upload(document), headers=key)  # the job has ended
            return [first, again, after]

    first, again, after = asyncio.run(scenario())
    assert [r.status_code for r in (first, again, after)] == [202, 202, 202], first.text
    job_id = first.json()["job_id"]
    assert again.json()["job_id"] == after.json()["job_id"] == job_id
    assert {r.headers["location"] for r in (first, again, after)} == {f"/v1/jobs/{job_id}"}
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == after.headers["idempotent-replayed"] == "true"
    shape = set(first.json()) - {"queue_position"}  # only the replica holding a queued job knows its place
    assert set(again.json()) - {"queue_position"} == shape and set(after.json()) == shape
    assert again.json()["created_at"] == first.json()["created_at"] and after.json()["status"] == "done"
    settle(app)
    assert parses == [len(document)]


def test_a_key_reused_for_another_request_is_422_and_keys_are_per_api_key(app, parses):
    document, other = page(2), page(3)
    key = {"Idempotency-Key": "k" * 255}  # the longest key accepted

    async def scenario() -> list[httpx.Response]:
        async with http(app, "alpha") as alpha, http(app, "beta") as beta:
            answers = [await alpha.post("/v1/jobs", files=upload(document), headers=key)]
            answers.append(await alpha.post("/v1/jobs", files=upload(other), headers=key))
            for fields in ({"pages": "1"}, {"formats": "markdown,json"}, {"password": "secret"}):
                answers.append(await alpha.post("/v1/jobs", files=upload(document), data=fields, headers=key))
            answers.append(await beta.post("/v1/jobs", files=upload(document), headers=key))
            return answers

    first, *reused, by_beta = asyncio.run(scenario())
    assert document != other
    assert first.status_code == 202, first.text
    for response in reused:
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "idempotency_key_reused" and "another request" in error["message"]
        assert error["request_id"] == response.headers["x-request-id"]
    assert by_beta.status_code == 202 and "idempotent-replayed" not in by_beta.headers
    assert by_beta.json()["job_id"] != first.json()["job_id"]  # another key's job: a job of its own
    settle(app)
    assert parses == [len(document)] * 2


@pytest.mark.parametrize(
    "value", ["", "k" * 256, "tab\tinside", "caf\u00e9".encode()], ids=["empty", "256", "tab", "utf8"]
)
def test_a_malformed_idempotency_key_is_400(app, parses, value):
    async def scenario() -> httpx.Response:
        async with http(app, "alpha") as client:
            return await client.post("/v1/jobs", files=upload(page(4)), headers={"Idempotency-Key": value})

    response = asyncio.run(scenario())
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "code": "invalid_idempotency_key",
            "message": "Idempotency-Key must be 1-255 printable ASCII characters",
            "request_id": response.headers["x-request-id"],
        }
    }
    settle(app)  # a job queued by mistake would run meanwhile
    assert parses == []


class LoseFirstSubmission(httpx.AsyncBaseTransport):
    """Hands each request to the application, then loses the answer to the first ``POST /v1/jobs``
    (the connection reset after the service accepted the upload); notes each submission's
    ``(Idempotency-Key, status, body)``."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.submissions: list[tuple[str | None, int, dict]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path == "/v1/jobs":
            await response.aread()
            self.submissions.append((request.headers.get("idempotency-key"), response.status_code, response.json()))
            if len(self.submissions) == 1:
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_the_client_s_retry_of_a_submission_whose_answer_was_lost_gets_the_same_job(app, parses):
    document = page(5)
    transport = LoseFirstSubmission(app)

    async def scenario() -> dict:
        retries = RetryPolicy(backoff=0.001, max_backoff=0.002)
        async with AsyncClient(
            BASE_URL, api_key=KEYS["alpha"], retries=retries, poll_interval=0.05, transport=transport
        ) as client:
            return await client.parse(document, timeout=120)

    result = asyncio.run(scenario())
    (key, status, lost), (again_key, again_status, again) = transport.submissions
    assert key is not None and again_key == key and (status, again_status) == (202, 202)
    assert again["job_id"] == lost["job_id"] == result["job_id"]  # the job the lost answer named
    settle(app)
    assert parses == [len(document)]
