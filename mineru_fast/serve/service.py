"""``Service``: the model, its workers and the service's readiness, shared by the routes.

Start-up (``load``, run in a background thread so ``/health`` answers meanwhile): build one parser
(the model is loaded once; every worker thread and every chat request share its engine loop, so
they batch together), run the engine check (``startup.run_engine_check``: a small image through
vision, prefill and a few decode steps, seconds), then start the job workers and become ready.
The canary page (``parsing.run_canary``: a whole replayed page, layout pass included) runs per
``ServeConfig.canary``: before the service becomes ready (``before-ready``), in a thread of its own
once it is ready while jobs are taken (``after-ready``, the default), or not at all (``off``).

A failure at any of these steps turns the state to ``failed`` (``/ready`` answers ``503`` saying
which step) and calls ``on_load_failure``. A canary that fails after the service became ready
stops it taking new work, lets the jobs in flight finish and their results be fetched (as a drain
does, within ``drain_timeout``), then calls ``on_load_failure``.

Shutdown: ``begin_drain`` (new jobs refused, status and results still served) until
``wait_drained``, then ``shutdown``, which closes the engine: a canary still running then ends
with its requests cancelled, and nothing waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.serve.bundle import BundleRequest, run_bundle
from mineru_fast.serve.config import ServeConfig
from mineru_fast.serve.errors import ApiError
from mineru_fast.serve.jobs import Job, JobManager
from mineru_fast.serve.metrics import ServiceMetrics
from mineru_fast.serve.parsing import ParseRequest, render_result, run_parse
from mineru_fast.serve.startup import Canary, run_engine_check
from mineru_fast.serve.store import HEARTBEAT_INTERVAL, JobStore, MemoryJobStore

logger = logging.getLogger(__name__)

__all__ = ["Service", "ServiceState"]

ServiceState = Literal["loading", "ready", "failed", "draining", "stopping"]
Stage = Literal["load", "engine_check", "canary"]

# What ``/ready`` says (503 ``model_load_failed``) after a failure at each start-up step; the
# details, which may name paths, are in the server's log only.
_FAILURE_MESSAGES: dict[Stage, str] = {
    "load": "the model failed to load; the server's log says why",
    "engine_check": "the engine check at start-up (a small image through the model) failed; the server's log says why",
    "canary": "the canary page failed to parse; this server takes no new work and should be replaced "
    "(the server's log says why)",
}


def model_label(model: str) -> str:
    """How ``/ready`` names the model: a hub id as given, a local directory by its name only."""
    return Path(model).name if Path(model).exists() else model


class Service:
    """Model, job manager, metrics and readiness of one running service.

    Args:
        config: the service settings.
        parser_factory: builds the parser (called once, at start-up).
        on_load_failure: called with the exception if loading, the engine check or the canary
            fails (the CLI uses it to stop the server with an error); after a canary that failed
            once the service was ready, only when the jobs in flight have drained.
        job_store: where jobs are recorded; default a ``MemoryJobStore`` keeping results
            ``config.result_ttl`` seconds (Ray Serve replicas pass their shared store).
        replica: this service's id in ``job_store`` (unique among the replicas sharing it).
    """

    def __init__(
        self,
        config: ServeConfig,
        parser_factory: Callable[[], DocumentParser],
        on_load_failure: Callable[[BaseException], None] | None = None,
        job_store: JobStore | None = None,
        replica: str = "local",
    ) -> None:
        self.config = config
        self.job_store = job_store if job_store is not None else MemoryJobStore(config.result_ttl)
        self.replica = replica
        self.parser_factory = parser_factory
        self.on_load_failure = on_load_failure
        self.state: ServiceState = "loading"
        self.load_error: str | None = None  # what failed, for the log and Ray's health check
        self.failed_stage: Stage | None = None  # the start-up step that failed
        self.stage: Stage = "load"  # the start-up step under way (or the last one)
        self.info: dict = {}
        self.canary = Canary(config.canary)
        self.canary_thread: threading.Thread | None = None  # the after-ready canary's
        self.jobs: JobManager | None = None
        self.parser: DocumentParser | None = None  # set once loaded
        self._drain_deadline: float | None = None  # time.monotonic() at which draining gives up
        self.metrics = ServiceMetrics(
            queue_length=lambda: self.jobs.queue_length if self.jobs else 0,
            in_flight=lambda: self.jobs.in_flight if self.jobs else 0,
        )
        self._lock = threading.Lock()

    # -- start-up and shutdown -------------------------------------------------------------------
    def load(self) -> None:
        """Build the parser, run the engine check, start the workers and become ready, with the
        canary page before (``before-ready``) or after (``after-ready``, in the thread
        ``canary``) becoming ready, or not at all; never raises (see ``state``)."""
        try:
            logger.info("loading model", extra={"worker": self.config.workers})
            start = time.perf_counter()
            parser = self.parser_factory()
            load_seconds = time.perf_counter() - start
            self.metrics.model_load_seconds.set(load_seconds)
            logger.info("model loaded", extra={"seconds": round(load_seconds, 3)})
            # Replayed documents (the canary, --allow-replay uploads) go through a second parser on
            # the same engine without the max_new_tokens bounds: a trace fixes the outputs (and so
            # their length), and a bound meant for free decoding would cut them.
            replay_parser = DocumentParser(
                parser.engine,
                replace(parser.options, max_new_tokens={}),
                parser.model_dir,
                parser.model_info,
                parser.layout_detector,
            )
            self.stage = "engine_check"
            check = run_engine_check(parser.engine)
            self.metrics.engine_check_seconds.set(check["seconds"])
            logger.info("engine check passed", extra={"seconds": check["seconds"], "tokens": check["tokens"]})
            if self.config.canary == "before-ready":
                self._run_canary(replay_parser)
            runner = self._runner(parser, replay_parser)
            jobs = JobManager(
                [runner] * self.config.workers,
                max_queued=self.config.queue_size,
                store=self.job_store,
                replica=self.replica,
                max_cost=self.config.decode_budget_bytes,
                on_finish=self._job_finished,
                # expiry runs with the heartbeat: a short result_ttl needs shorter rounds
                heartbeat=max(0.2, min(HEARTBEAT_INTERVAL, self.config.result_ttl / 4)),
            )
            with self._lock:
                if self.state != "loading":  # shut down while loading
                    return
                self.info = {
                    "model": model_label(self.config.model),
                    "engine": parser.options.engine,
                    "workers": self.config.workers,
                    "model_load_seconds": round(load_seconds, 3),
                    "engine_check": check,
                }
                self.jobs, self.parser = jobs, parser
                jobs.start()
                self.state = "ready"
                if self.config.canary == "after-ready":
                    self.canary_thread = threading.Thread(
                        target=self._canary_after_ready, args=(replay_parser,), name="canary", daemon=True
                    )
                    self.canary_thread.start()
            self.metrics.ready.set(1)
            logger.info("ready", extra={"worker": self.config.workers, "queue_length": 0})
        except Exception as exc:
            step = {"load": "model load", "engine_check": "engine check", "canary": "canary page"}[self.stage]
            with self._lock:
                self.state, self.failed_stage = "failed", self.stage
                self.load_error = f"{step} failed: {type(exc).__name__}: {exc}"
            logger.error("start-up failed: %s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure(exc)

    def _run_canary(self, replay_parser: DocumentParser) -> None:
        """Parse the canary page (``Canary.run``), its time in ``mineru_fast_canary_seconds``.

        Raises:
            Exception: the canary failed (whatever ``run_canary`` raised).
        """
        self.stage = "canary"
        logger.info("canary page started", extra={"status": self.config.canary})
        outcome = self.canary.run(replay_parser)
        self.metrics.canary_seconds.set(outcome["seconds"])
        logger.info("canary page parsed", extra={"seconds": outcome["seconds"], "status": outcome["status"]})

    def _canary_after_ready(self, replay_parser: DocumentParser) -> None:
        """The ``after-ready`` canary (thread ``canary``); a failure goes to ``_canary_failed``."""
        try:
            self._run_canary(replay_parser)
        except Exception as exc:
            self._canary_failed(exc)

    def _canary_failed(self, exc: Exception) -> None:
        """A canary that failed after the service became ready: state ``failed`` (no new work,
        ``/ready`` ``503``), the jobs in flight finish and are collected (in ``drain_timeout``),
        then ``on_load_failure``. Once shutdown began it changes nothing (a canary ended by the
        engine's closing fails; that says nothing of the model)."""
        with self._lock:
            if self.state != "ready" or self.jobs is None:
                logger.info("canary page ended by shutdown", extra={"status": self.state})
                return
            self.state, self.failed_stage = "failed", "canary"
            self.load_error = f"canary page failed: {type(exc).__name__}: {exc}"
            self._drain_deadline = time.monotonic() + self.config.drain_timeout
            jobs = self.jobs
        jobs.stop_accepting()
        self.metrics.ready.set(0)
        logger.error(
            "%s; no new work is taken, the jobs in flight finish",
            self.load_error,
            extra={"queue_length": jobs.queue_length, "in_flight": jobs.in_flight},
        )
        if self.on_load_failure is None:
            return
        start = time.monotonic()
        drained = jobs.wait_drained(self._time_left())
        seconds = round(time.monotonic() - start, 3)
        logger.info("drained" if drained else "drain timed out", extra={"seconds": seconds})
        self.on_load_failure(exc)

    def ready_info(self) -> dict:
        """What ``/ready`` says of a ready service: model, engine, workers, model load and engine
        check figures (``startup.run_engine_check``) and the canary's mode and state
        (``Canary.describe``)."""
        return {**self.info, "canary": self.canary.describe()}

    def begin_drain(self) -> bool:
        """Refuse new jobs (``503``) while queued and running jobs finish and their results are
        fetched; status and result requests go on.

        Returns:
            True when there are workers to drain (the service is ready, or its canary failed after
            it became ready); False while loading or after a failed start (then there is nothing
            to wait for).
        """
        with self._lock:
            if self.state not in ("ready", "failed") or self.jobs is None:
                return False
            self.state = "draining"
            deadline = time.monotonic() + self.config.drain_timeout
            # a drain that began when the canary failed keeps its deadline
            self._drain_deadline = deadline if self._drain_deadline is None else min(deadline, self._drain_deadline)
            jobs = self.jobs
        jobs.stop_accepting()
        self.metrics.ready.set(0)
        logger.info("draining", extra={"queue_length": jobs.queue_length, "in_flight": jobs.in_flight})
        return True

    def _time_left(self) -> float:
        """Seconds of the drain left (``drain_timeout`` when no drain began)."""
        if self._drain_deadline is None:
            return self.config.drain_timeout
        return max(0.0, self._drain_deadline - time.monotonic())

    def drain_expired(self) -> bool:
        """True once a drain has used up ``drain_timeout``, or the service is stopping: requests
        still waiting for a job must be answered now."""
        if self.state == "stopping":
            return True
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    def wait_drained(self) -> bool:
        """Wait, until the drain's deadline, for every job to finish and be collected; returns whether so."""
        jobs = self.jobs
        return jobs is None or jobs.wait_drained(self._time_left())

    def shutdown(self) -> None:
        """Stop accepting jobs, let queued and running ones finish (in what is left of
        ``drain_timeout``), stop the workers and close the engine (a canary still running ends
        with its requests cancelled; nothing waits for it)."""
        with self._lock:
            self.state = "stopping"
            jobs = self.jobs
        self.metrics.ready.set(0)
        if jobs is None:
            logger.info("stopped", extra={"cancelled": 0})
            return
        cancelled = jobs.shutdown(self._time_left())
        if self.parser is not None:
            self.parser.close()
        logger.info("stopped", extra={"cancelled": len(cancelled)})

    # -- readiness -------------------------------------------------------------------------------
    def require_parser(self) -> DocumentParser:
        """The shared parser, if the service takes work now (see ``require_ready``)."""
        self.require_ready()
        assert self.parser is not None
        return self.parser

    def require_ready(self) -> JobManager:
        """The job manager, if the service takes work now.

        Raises:
            ApiError: 503 ``not_ready`` (loading, with ``Retry-After``), ``model_load_failed`` (the
                model load, the engine check or the canary page failed: the message says which) or
                ``shutting_down``.
        """
        with self._lock:
            state, jobs, stage, failed = self.state, self.jobs, self.stage, self.failed_stage
        if state == "ready" and jobs is not None:
            return jobs
        if state == "loading":
            doing = {
                "load": "the model is still loading",
                "engine_check": "the engine is being checked",
                "canary": "the canary page is being parsed (--canary before-ready)",
            }[stage]
            raise ApiError(503, "not_ready", doing, {"Retry-After": "5"})
        if state == "failed":
            raise ApiError(503, "model_load_failed", _FAILURE_MESSAGES[failed or "load"])
        raise ApiError(503, "shutting_down", "the server is shutting down and takes no new jobs")

    # -- jobs ------------------------------------------------------------------------------------
    @staticmethod
    def _runner(parser: DocumentParser, replay_parser: DocumentParser) -> Callable[[Job], dict]:
        """The job runner every worker thread uses (parsers are thread-safe; the workers'
        documents share the engine's batch). Replayed uploads go to ``replay_parser``; a
        ``BundleRequest`` (MinerU's document API) is parsed into MinerU 4's bundle."""

        def run(job: Job) -> dict:
            request: ParseRequest = job.payload
            chosen = replay_parser if request.trace is not None else parser
            if isinstance(request, BundleRequest):
                return run_bundle(chosen, request, job.report_progress)
            document, overlays = run_parse(chosen, request, job.report_progress)
            return render_result(document, request.formats, overlays)

        return run

    def _job_finished(self, job: Job, run_seconds: float) -> None:
        if job.status == "cancelled":
            self.metrics.observe_job("cancelled", None, None, [])
            return
        wait = job.started_mono - job.queued_mono if job.started_mono is not None else None
        pages = [p["status"] for p in job.result["pages"]] if job.result else []
        self.metrics.observe_job(job.status, run_seconds, wait, pages)
        logger.info(
            "job finished",
            extra={
                "job_id": job.id,
                "request_id": job.request_id,
                "status": job.status,
                "pages": len(pages),
                "seconds": round(run_seconds, 3),
                "code": job.error.code if job.error else None,
            },
        )
