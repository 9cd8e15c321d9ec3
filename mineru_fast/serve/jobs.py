"""The bounded job queue and its worker threads.

A ``Job`` waits in a queue of at most ``max_queued`` entries until one of the worker threads takes
it; each worker owns one runner (the runners share one parser, which is thread-safe: concurrent
documents share its engine batch), so documents are parsed off the event loop and at most
``len(runners)`` at a time. A submission to a full queue raises
``QueueFull``, one whose cost would take the jobs admitted (queued and running) over ``max_cost``
raises ``OverBudget`` (the application answers ``429`` with ``Retry-After``). Finished jobs keep
their result for ``result_ttl`` seconds, then a sweeper thread deletes them; jobs submitted with
``retain=False`` (synchronous calls) are never stored. ``stop_accepting`` and ``wait_drained``
make a graceful drain (no new jobs; wait until the jobs unfinished at that moment have finished
and their outcomes have been collected);
``shutdown`` stops the workers, letting queued and running jobs finish within a time limit and
cancelling what is left.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ApiError, from_exception

logger = logging.getLogger(__name__)

__all__ = ["Job", "JobManager", "QueueFull", "OverBudget", "ShuttingDown", "JobStatus"]

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
FINISHED: tuple[JobStatus, ...] = ("done", "failed", "cancelled")


class QueueFull(Exception):
    """The queue holds ``max_queued`` jobs already.

    Attributes:
        retry_after: suggested seconds before trying again.
    """

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the job queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class OverBudget(QueueFull):
    """Admitting the job would take the cost of the admitted jobs over ``max_cost``."""


class ShuttingDown(Exception):
    """The manager no longer accepts jobs (graceful shutdown under way)."""


@dataclass(eq=False)
class Job:
    """One parse job and everything a client may ask about it.

    Attributes:
        payload: what the runner needs (released once the job has run).
        owner: API key name that submitted the job (None without keys); only it may read the job.
        request_id: id of the submitting request, for the logs.
        pages_total / pages_done: per-page progress, reported by the runner.
        cost: what the job holds while admitted, counted against the manager's ``max_cost``
            (the service uses decoded pixels).
        retain: keep the job, findable by id, until ``result_ttl`` after it finished; False for a
            job whose submitter waits for it (its result goes out once and is not stored).
        collected: its outcome has been handed to a client (set by ``JobManager.collect``).
        result: the runner's JSON-ready result once ``done``.
        error: the ``ApiError`` once ``failed`` or ``cancelled``.
    """

    payload: Any
    owner: str | None = None
    request_id: str | None = None
    pages_total: int | None = None
    cost: int = 0
    retain: bool = True
    collected: bool = False
    id: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    status: JobStatus = "queued"
    pages_done: int = 0
    result: dict | None = None
    error: ApiError | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    finished_mono: float | None = None
    queued_mono: float = field(default_factory=time.monotonic)
    started_mono: float | None = None
    _callbacks: list[Callable[[Job], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def report_progress(self, done: int, total: int) -> None:
        """Record that ``done`` of ``total`` pages are parsed (called from the worker thread)."""
        self.pages_done, self.pages_total = done, total

    def add_done_callback(self, callback: Callable[[Job], None]) -> None:
        """Call ``callback(job)`` once the job is finished (at once if it already is).

        The callback runs in the thread that finishes the job; it must be quick and thread-safe
        (e.g. ``loop.call_soon_threadsafe``).
        """
        with self._lock:
            if self.status not in FINISHED:
                self._callbacks.append(callback)
                return
        callback(self)

    def _finish(self, status: JobStatus, result: dict | None = None, error: ApiError | None = None) -> None:
        with self._lock:
            self.status, self.result, self.error = status, result, error
            self.finished_at = time.time()
            self.payload = None
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("job done-callback failed", extra={"job_id": self.id})

    def describe(self, queue_position: int | None = None) -> dict:
        """The job's status as JSON-ready data (no result)."""
        out: dict[str, Any] = {
            "job_id": self.id,
            "status": self.status,
            "pages": {"total": self.pages_total, "done": self.pages_done},
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }
        if queue_position is not None:
            out["queue_position"] = queue_position
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.message}
        return out


class JobManager:
    """Bounded queue + one worker thread per runner + TTL sweeper.

    Args:
        runners: one callable per worker, ``runner(job) -> dict`` (the result); it may call
            ``job.report_progress``; exceptions it raises become the job's error.
        max_queued: jobs that may wait; a submission beyond it raises ``QueueFull``.
        result_ttl: seconds a finished job is kept.
        max_cost: most total ``Job.cost`` of the jobs queued and running; None = no limit.
        on_finish: called as ``on_finish(job, run_seconds)`` after each job, cancelled ones included
            (metrics, logs).
        clock: monotonic clock for the TTL (injectable for tests).
    """

    def __init__(
        self,
        runners: list[Callable[[Job], dict]],
        *,
        max_queued: int,
        result_ttl: float,
        max_cost: int | None = None,
        on_finish: Callable[[Job, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not runners or max_queued < 1 or result_ttl <= 0:
            raise ValueError("need at least one runner, max_queued >= 1 and result_ttl > 0")
        self.runners, self.max_queued, self.result_ttl = runners, max_queued, result_ttl
        self.max_cost = max_cost
        self._cost = 0  # total cost of the jobs queued and running
        self.on_finish, self.clock = on_finish, clock
        self._queue: deque[Job] = deque()
        self._jobs: dict[str, Job] = {}
        self._cond = threading.Condition()
        self._running = 0
        self._accepting = False
        self._awaited: list[Job] = []  # stored jobs unfinished when accepting stopped: drain waits for them
        self._stopping = False
        self._stopped = threading.Event()  # wakes the sweeper at shutdown
        self._threads: list[threading.Thread] = []
        self._run_seconds = 1.0  # moving average of job run time, for Retry-After

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker threads and the sweeper; jobs are accepted from now on."""
        with self._cond:
            if self._threads:
                return
            self._accepting = True
        for index, runner in enumerate(self.runners):
            thread = threading.Thread(
                target=self._work, args=(index, runner), name=f"parse-worker-{index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        sweeper = threading.Thread(target=self._sweep_loop, name="job-sweeper", daemon=True)
        self._threads.append(sweeper)
        sweeper.start()

    def stop_accepting(self) -> None:
        """Refuse new jobs from now on (``submit`` raises ``ShuttingDown``); the workers go on.

        The stored jobs queued or running now are those ``drained`` waits to see collected.
        """
        with self._cond:
            if self._accepting:
                self._awaited = [job for job in self._jobs.values() if job.status not in FINISHED]
            self._accepting = False
            self._cond.notify_all()

    def drained(self) -> bool:
        """True when no job is queued or running, and each job that was unfinished when accepting
        stopped has been collected (or has expired)."""
        with self._cond:
            return self._drained_locked()

    def _drained_locked(self) -> bool:
        if self._queue or self._running:
            return False
        return all(job.collected or job.id not in self._jobs for job in self._awaited)

    def wait_drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until ``drained()``; returns whether it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._drained_locked():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(0.5, left))
            return True

    def collect(self, job: Job) -> None:
        """Record that a finished job's outcome has been handed to its client (see ``drained``)."""
        with self._cond:
            job.collected = True
            self._cond.notify_all()

    @property
    def cost(self) -> int:
        """Total cost of the jobs queued and running."""
        with self._cond:
            return self._cost

    def shutdown(self, drain_timeout: float) -> list[Job]:
        """Stop accepting, wait up to ``drain_timeout`` s for queued and running jobs, cancel the rest.

        Returns:
            The jobs cancelled because the time ran out (they never started).
        """
        deadline = time.monotonic() + drain_timeout
        with self._cond:
            self._accepting = False
            while (self._queue or self._running) and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            cancelled = list(self._queue)
            self._queue.clear()
            self._cost -= sum(job.cost for job in cancelled)
            self._stopping = True
            self._cond.notify_all()
        self._stopped.set()
        for job in cancelled:
            job._finish("cancelled", error=ApiError(503, "shutting_down", "the server shut down before the job ran"))
            job.finished_mono = self.clock()
            logger.warning("job cancelled by shutdown", extra={"job_id": job.id, "request_id": job.request_id})
            if self.on_finish is not None:
                self.on_finish(job, 0.0)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        return cancelled

    # -- submission and lookup -------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job.

        Raises:
            ShuttingDown: the manager is not accepting jobs.
            QueueFull: ``max_queued`` jobs are already waiting.
            OverBudget: the job's cost does not fit in what ``max_cost`` leaves now.
        """
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is not accepting jobs")
            if len(self._queue) >= self.max_queued:
                raise QueueFull(self._retry_after_locked())
            if self.max_cost is not None and self._cost + job.cost > self.max_cost:
                raise OverBudget(self._retry_after_locked())
            job.queued_mono = time.monotonic()
            self._queue.append(job)
            self._cost += job.cost
            if job.retain:
                self._jobs[job.id] = job
            self._cond.notify_all()
        return job

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job with this id, if it exists, has not expired and belongs to ``owner``."""
        with self._cond:
            job = self._jobs.get(job_id)
        if job is None or job.owner != owner:
            return None
        return job

    def queue_position(self, job: Job) -> int | None:
        """1-based position of a queued job (1 = next to run), None if it is not queued."""
        with self._cond:
            for position, queued in enumerate(self._queue, start=1):
                if queued is job:
                    return position
        return None

    @property
    def queue_length(self) -> int:
        """Jobs waiting for a worker."""
        with self._cond:
            return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Jobs being parsed now."""
        with self._cond:
            return self._running

    @property
    def stored(self) -> int:
        """Jobs held (queued, running, or finished and not yet expired)."""
        with self._cond:
            return len(self._jobs)

    def _retry_after_locked(self) -> int:
        ahead = len(self._queue) + self._running
        return max(1, min(120, math.ceil(self._run_seconds * ahead / len(self.runners))))

    # -- workers ---------------------------------------------------------------------------------
    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._queue:
                return None
            job = self._queue.popleft()
            job.status, job.started_at, job.started_mono = "running", time.time(), time.monotonic()
            self._running += 1
            return job

    def _work(self, index: int, runner: Callable[[Job], dict]) -> None:
        while (job := self._next()) is not None:
            start = time.monotonic()
            try:
                result = runner(job)
            except Exception as exc:  # one job fails alone; the worker goes on
                error = from_exception(exc)
                if error.status >= 500:
                    logger.exception("job crashed", extra={"job_id": job.id, "request_id": job.request_id})
                job._finish("failed", error=error)
            else:
                job._finish("done", result=result)
            job.finished_mono = self.clock()
            seconds = time.monotonic() - start
            with self._cond:
                self._running -= 1
                self._cost -= job.cost
                self._run_seconds = 0.8 * self._run_seconds + 0.2 * seconds
                self._cond.notify_all()
            if self.on_finish is not None:
                try:
                    self.on_finish(job, seconds)
                except Exception:
                    logger.exception("on_finish hook failed", extra={"job_id": job.id})
            logger.debug("worker %d idle", index, extra={"worker": index})

    # -- expiry ----------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Delete finished jobs older than ``result_ttl``.

        Returns:
            How many were deleted.
        """
        now = self.clock()
        with self._cond:
            expired = [
                job_id
                for job_id, job in self._jobs.items()
                if job.finished_mono is not None and now - job.finished_mono >= self.result_ttl
            ]
            for job_id in expired:
                del self._jobs[job_id]
        return len(expired)

    def _sweep_loop(self) -> None:
        interval = max(0.2, min(5.0, self.result_ttl / 4))
        while not self._stopped.wait(timeout=interval):
            removed = self.sweep()
            if removed:
                logger.debug("expired %d job result(s)", removed)
