"""Prometheus metrics of the service, in a registry of their own (one per application).

``mineru_fast_queue_length`` is the number to scale on: jobs waiting for a worker.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServiceMetrics", "route_label", "method_label", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ROUTES = {
    "/",
    "/health",
    "/ready",
    "/metrics",
    "/v1/document/parse",
    "/v1/jobs",
    "/v1/chat/completions",
    "/v1/models",
    # MinerU's document API (mineru_api)
    "/v1/health",
    "/v1/uploads",
    "/v1/parse/jobs",
    "/v1/tasks",
    "/v1/file_parse",
}
_TEMPLATES = [  # routes with an id in their path, as (pattern, label)
    (re.compile(r"^/v1/jobs/[^/]+/result$"), "/v1/jobs/{job_id}/result"),
    (re.compile(r"^/v1/jobs/[^/]+$"), "/v1/jobs/{job_id}"),
    (re.compile(r"^/v1/uploads/[^/]+/(content|complete|cancel)$"), "/v1/uploads/{upload_id}/{step}"),
    (re.compile(r"^/v1/uploads/[^/]+$"), "/v1/uploads/{upload_id}"),
    (re.compile(r"^/v1/files/[^/]+/content$"), "/v1/files/{file_id}/content"),
    (re.compile(r"^/v1/files/[^/]+$"), "/v1/files/{file_id}"),
    (re.compile(r"^/v1/parse/jobs/[^/]+$"), "/v1/parse/jobs/{job_id}"),
    (re.compile(r"^/v1/tasks/[^/]+/result$"), "/v1/tasks/{task_id}/result"),
    (re.compile(r"^/v1/tasks/[^/]+$"), "/v1/tasks/{task_id}"),
]
_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"}


def route_label(path: str) -> str:
    """A bounded label for a request path: the route template, or ``"other"``."""
    if path in _ROUTES:
        return path
    return next((label for pattern, label in _TEMPLATES if pattern.match(path)), "other")


def method_label(method: str) -> str:
    """A bounded label for an HTTP method: the standard ones as they are, anything else ``"other"``."""
    return method if method in _METHODS else "other"


class ServiceMetrics:
    """Every metric the service exports.

    Args:
        queue_length: returns the jobs waiting now (read at scrape time).
        in_flight: returns the jobs being parsed now (read at scrape time).
    """

    def __init__(self, queue_length: Callable[[], int], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("mineru_fast_queue_length", "Jobs waiting for a worker", registry=r)
        self.queue_length.set_function(lambda: float(queue_length()))
        self.in_flight = Gauge("mineru_fast_jobs_in_flight", "Jobs being parsed", registry=r)
        self.in_flight.set_function(lambda: float(in_flight()))
        self.requests = Counter(
            "mineru_fast_requests",
            "HTTP requests by route, method (standard ones, else other) and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "mineru_fast_request_duration_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.jobs = Counter(
            "mineru_fast_jobs", "Jobs by final status (done, failed, cancelled, rejected)", ["status"], registry=r
        )
        self.pages = Counter(
            "mineru_fast_pages", "Parsed pages by status (success, partial, failure)", ["status"], registry=r
        )
        self.queue_wait_seconds = Histogram(
            "mineru_fast_queue_wait_seconds", "Time jobs waited for a worker", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.parse_seconds = Histogram(
            "mineru_fast_parse_duration_seconds", "Time a worker spent on a job", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.model_load_seconds = Gauge("mineru_fast_model_load_seconds", "Model load time at start-up", registry=r)
        self.engine_check_seconds = Gauge(
            "mineru_fast_engine_check_seconds",
            "Start-up engine check time (a small image through vision, prefill and decode)",
            registry=r,
        )
        self.canary_seconds = Gauge(
            "mineru_fast_canary_seconds", "Canary page parse time (set once it passed; --canary)", registry=r
        )
        self.ready = Gauge(
            "mineru_fast_ready",
            "1 when the service takes work: model loaded, engine check passed (and the canary parsed with "
            "--canary before-ready); 0 again once draining or failed",
            registry=r,
        )

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None:
        """Count one answered HTTP request and its latency."""
        route = route_label(path)
        self.requests.labels(route=route, method=method_label(method), status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    def observe_job(
        self, status: str, run_seconds: float | None, wait_seconds: float | None, page_statuses: list[str]
    ) -> None:
        """Count one finished (or rejected) job, its timings and its pages."""
        self.jobs.labels(status=status).inc()
        if run_seconds is not None:
            self.parse_seconds.observe(run_seconds)
        if wait_seconds is not None:
            self.queue_wait_seconds.observe(wait_seconds)
        for page_status in page_statuses:
            self.pages.labels(status=page_status).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (content type ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
