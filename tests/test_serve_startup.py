"""The service's start-up: ready after the engine check, the canary page before, after or never.

In process (the application under Starlette's test client, the tiny model): the canary and the jobs
are held on events, so every step is waited on as a state, never as an amount of time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import pytest
from samples import image_bytes, sample_trace, text_page
from serve_helpers import wait_for

for _module in ("fastapi", "uvicorn", "prometheus_client", "multipart", "httpx"):
    pytest.importorskip(_module, reason="the serve tests need the serve extra: pip install 'mineru-fast[serve]'")

from fastapi.testclient import TestClient  # noqa: E402

from mineru_fast import ParserOptions  # noqa: E402
from mineru_fast.engine.base import GenerationResult, RequestHandle, generate_with_follow_ups  # noqa: E402
from mineru_fast.pipeline.parser import DocumentParser  # noqa: E402
from mineru_fast.serve import parsing, service, startup  # noqa: E402
from mineru_fast.serve.app import create_app  # noqa: E402
from mineru_fast.serve.config import ServeConfig  # noqa: E402

TIMEOUT = 120.0  # a bound on a hang, never a wait: every wait below ends on a state


class Gate:
    """Holds a step until released: ``started`` once it was reached, ``release`` lets it go on."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def hold(self) -> None:
        self.calls += 1
        self.started.set()
        assert self.release.wait(TIMEOUT), "the test never released the gate"


class FaultyEngine:
    """An engine whose results pass through ``fault`` (a ``GenerationResult`` -> one)."""

    def __init__(self, engine, fault) -> None:
        self.engine, self.fault = engine, fault
        self.preprocessor = engine.preprocessor

    def submit(self, request) -> RequestHandle:
        inner, handle = self.engine.submit(request), RequestHandle(request)
        inner.future.add_done_callback(lambda future: handle.set_result(self.fault(future.result())))
        return handle

    def generate(self, requests, on_result=None) -> list[GenerationResult]:
        return generate_with_follow_ups(self.submit, requests, on_result)

    def close(self) -> None:
        self.engine.close()


def nan_logprobs(result: GenerationResult) -> GenerationResult:
    return dataclasses.replace(result, logprobs=[math.nan] * len(result.logprobs or []))


def other_tokens(result: GenerationResult) -> GenerationResult:
    return dataclasses.replace(result, token_ids=[(t + 1) % 1000 for t in result.token_ids])


@pytest.fixture
def canary_gate(monkeypatch) -> Gate:
    """The canary page held until ``release``, then parsed for real."""
    gate, real = Gate(), parsing.run_canary

    def held(parser):
        gate.hold()
        return real(parser)

    monkeypatch.setattr(startup, "run_canary", held)
    return gate


class Started:
    """An application under the test client, with what its ``on_load_failure`` got."""

    def __init__(self, tiny_model, canary: str | None = None, fault=None, **settings) -> None:
        options = ParserOptions.preset("exact", threads=1, page_window=1)
        fields = {"canary": canary} if canary is not None else {}
        config = ServeConfig(model=str(tiny_model), options=options, workers=1, allow_replay=True, **fields, **settings)
        self.failures: list[BaseException] = []
        self.failed = threading.Event()

        def build() -> DocumentParser:
            parser = DocumentParser.from_pretrained(tiny_model, options)
            if fault is not None:
                parser.engine = FaultyEngine(parser.engine, fault)
            return parser

        def load_failed(exc: BaseException) -> None:
            self.failures.append(exc)
            self.failed.set()

        self.app = create_app(config, parser_factory=build, on_load_failure=load_failed)
        self.service = self.app.state.service
        self.client = TestClient(self.app, base_url="http://127.0.0.1")

    def __enter__(self) -> Started:
        self.client.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.__exit__(*exc)

    def ready(self):
        return self.client.get("/ready")

    def wait_ready(self) -> dict:
        assert wait_for(lambda: self.ready().status_code == 200 or self.service.state == "failed", TIMEOUT)
        response = self.ready()
        assert response.status_code == 200, response.text
        return response.json()

    def metric(self, name: str) -> float:
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def submit(self) -> dict:
        files = {
            "file": ("page.png", image_bytes(text_page(), "PNG"), "application/octet-stream"),
            "replay": ("trace.json", json.dumps(sample_trace(1).to_dict()).encode(), "application/json"),
        }
        response = self.client.post("/v1/jobs", files=files)
        assert response.status_code == 202, response.text
        return response.json()

    def job_status(self, job: dict) -> str:
        return self.client.get(job["status_url"]).json()["status"]


def test_ready_after_the_engine_check_while_the_canary_runs_and_jobs_are_taken(tiny_model, canary_gate):
    """The canary page (a 1036x1036 layout pass: ~60 s at full size on 2 cores) held /ready at 503."""
    with Started(tiny_model) as started:  # after-ready is the default
        ready = started.wait_ready()
        assert canary_gate.started.wait(TIMEOUT)
        ready = started.ready().json()
        assert ready["status"] == "ready" and ready["canary"] == {"mode": "after-ready", "state": "running"}
        check = ready["engine_check"]
        assert check["seconds"] > 0 and check["image_tokens"] == 16 and check["prompt_tokens"] > 16
        assert check["tokens"] == len(started.service.parser.engine.preprocessor.forced_ids(startup.ENGINE_CHECK_TEXT))
        assert started.metric("mineru_fast_engine_check_seconds") > 0 and started.metric("mineru_fast_ready") == 1
        assert started.metric("mineru_fast_canary_seconds") == 0

        job = started.submit()  # taken, and parsed, while the canary waits
        assert wait_for(lambda: started.job_status(job) == "done", TIMEOUT)
        assert started.client.get(job["result_url"]).json()["status"] == "success"
        assert started.ready().json()["canary"]["state"] == "running"

        canary_gate.release.set()
        assert wait_for(lambda: started.ready().json()["canary"]["state"] == "passed", TIMEOUT)
        canary = started.ready().json()["canary"]
        assert canary["seconds"] > 0 and canary["blocks"] == 3
        assert started.metric("mineru_fast_canary_seconds") > 0
    assert not started.failures and canary_gate.calls == 1


@pytest.mark.parametrize("fault", [nan_logprobs, other_tokens], ids=["non-finite", "other-tokens"])
def test_a_failing_engine_check_fails_the_start(tiny_model, canary_gate, fault):
    with Started(tiny_model, fault=fault) as started:
        assert started.failed.wait(TIMEOUT)
        assert started.service.state == "failed"
        response = started.ready()
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "model_load_failed" and "engine check" in error["message"]
        assert isinstance(started.failures[0], startup.EngineCheckFailed)
        assert "engine check failed" in started.service.load_error
        assert started.metric("mineru_fast_ready") == 0
    assert canary_gate.calls == 0  # never reached


def test_a_canary_failing_after_ready_turns_ready_to_503_and_lets_jobs_in_flight_finish(tiny_model, monkeypatch):
    canary, job_gate = Gate(), Gate()

    def failing_canary(parser):
        canary.hold()
        raise RuntimeError("the canary page failed to parse: test fault")

    real_parse = service.run_parse

    def held_parse(*args, **kwargs):
        job_gate.hold()
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(startup, "run_canary", failing_canary)
    monkeypatch.setattr(service, "run_parse", held_parse)
    with Started(tiny_model, canary="after-ready") as started:
        started.wait_ready()
        assert canary.started.wait(TIMEOUT)
        job = started.submit()
        assert job_gate.started.wait(TIMEOUT) and started.job_status(job) == "running"

        canary.release.set()
        assert wait_for(lambda: started.ready().status_code == 503, TIMEOUT)
        error = started.ready().json()["error"]
        assert error["code"] == "model_load_failed" and "canary" in error["message"]
        assert started.service.state == "failed" and "canary page failed" in started.service.load_error
        refused = started.client.post("/v1/jobs", files={"file": ("p.png", image_bytes(text_page(), "PNG"))})
        assert refused.status_code == 503 and "canary" in refused.json()["error"]["message"]
        assert started.metric("mineru_fast_ready") == 0
        assert started.job_status(job) == "running" and not started.failures  # the job in flight goes on

        job_gate.release.set()
        assert wait_for(lambda: started.job_status(job) == "done", TIMEOUT)
        assert not started.failures  # its result has not been fetched yet
        assert started.client.get(job["result_url"]).json()["status"] == "success"
        assert started.failed.wait(TIMEOUT)  # then the server is told to stop
        assert "test fault" in str(started.failures[0])
        assert started.service.canary.describe()["state"] == "failed"


def test_canary_before_ready_holds_ready_until_it_passed(tiny_model, canary_gate):
    with Started(tiny_model, canary="before-ready") as started:
        assert canary_gate.started.wait(TIMEOUT)
        response = started.ready()
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "not_ready" and "canary" in error["message"]
        assert started.metric("mineru_fast_engine_check_seconds") > 0  # the engine check came first
        canary_gate.release.set()
        ready = started.wait_ready()
        assert ready["canary"]["mode"] == "before-ready" and ready["canary"]["state"] == "passed"
        assert ready["canary"]["seconds"] > 0 and started.metric("mineru_fast_canary_seconds") > 0
    assert not started.failures


def test_a_canary_failing_before_ready_fails_the_start(tiny_model, monkeypatch):
    def failing_canary(parser):
        raise RuntimeError("the canary page failed to parse: test fault")

    monkeypatch.setattr(startup, "run_canary", failing_canary)
    with Started(tiny_model, canary="before-ready") as started:
        assert started.failed.wait(TIMEOUT)
        error = started.ready().json()["error"]
        assert error["code"] == "model_load_failed" and "canary" in error["message"]
        assert started.service.state == "failed" and started.service.canary.describe()["state"] == "failed"


def test_canary_off_is_never_parsed(tiny_model, canary_gate):
    with Started(tiny_model, canary="off") as started:
        ready = started.wait_ready()
        assert ready["canary"] == {"mode": "off", "state": "off"}
        job = started.submit()
        assert wait_for(lambda: started.job_status(job) == "done", TIMEOUT)
    assert canary_gate.calls == 0 and not started.failures


def test_shutdown_does_not_wait_for_a_running_canary_and_its_end_changes_nothing(tiny_model, canary_gate):
    started = Started(tiny_model).__enter__()
    started.wait_ready()
    assert canary_gate.started.wait(TIMEOUT)
    stopper = threading.Thread(target=started.__exit__, args=(None, None, None))
    stopper.start()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()  # stopped while the canary is still held
    assert started.service.state == "stopping"
    canary_gate.release.set()  # it goes on now, on a closed engine, and fails
    started.service.canary_thread.join(TIMEOUT)
    assert not started.service.canary_thread.is_alive()
    assert started.service.state == "stopping" and not started.failures


def test_the_canary_flag_and_setting():
    import argparse

    from mineru_fast.cli.serve import add_serve_command, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["serve"])).canary == "after-ready"
    for mode in ("after-ready", "before-ready", "off"):
        assert config_from_args(parser.parse_args(["serve", "--canary", mode])).canary == mode
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--canary", "sometimes"])
    with pytest.raises(ValueError, match="canary"):
        ServeConfig(canary="sometimes")  # type: ignore[arg-type]
