"""The service's access log: one line per request, probes answered OK left out at INFO."""

from __future__ import annotations

import asyncio
import logging

from mineru_fast.serve.context import RequestContextMiddleware
from mineru_fast.serve.metrics import ServiceMetrics


def _request(app, path: str) -> None:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))


def test_probes_answered_ok_are_not_logged_at_info(caplog):
    """``serve`` logged every ``/health`` and ``/ready`` probe, a line every few seconds per balancer."""
    status = {"/health": 200, "/ready": 503, "/v1/jobs": 202}

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status.get(scope["path"], 200), "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = RequestContextMiddleware(app, ServiceMetrics(queue_length=lambda: 0, in_flight=lambda: 0))
    with caplog.at_level(logging.DEBUG, logger="mineru_fast.serve.context"):
        for path in ("/health", "/ready", "/v1/jobs", "/health"):
            _request(middleware, path)
    logged = [(r.levelno, r.route, r.status) for r in caplog.records if r.getMessage() == "request"]
    assert logged == [
        (logging.DEBUG, "/health", 200),
        (logging.INFO, "/ready", 503),  # a failing probe is news
        (logging.INFO, "/v1/jobs", 202),
        (logging.DEBUG, "/health", 200),
    ]
