"""The bounded job queue and its worker threads.

A ``Job`` waits in a queue of at most ``max_queued`` entries until one of the worker threads takes
it; each worker owns one runner (the runners share one parser, which is thread-safe: concurrent
documents share its engine batch), so documents are parsed off the event loop and at most
``len(runners)`` at a time. A submission to a full queue raises ``QueueFull``, one whose cost
would take what is admitted (the jobs queued and running, and what other doors hold in the same
``CostBudget``) over ``max_cost`` raises ``OverBudget`` (the application answers ``429`` with
``Retry-After``). Jobs submitted with
``retain=True`` (``POST /v1/jobs``) are recorded in a ``JobStore`` (``store``), where they can be
looked up by id until ``result_ttl`` after they finished (one whose idempotency key the store
holds already for its owner is not queued: ``AlreadySubmitted``); jobs submitted with
``retain=False`` (synchronous calls) are never stored. A maintenance thread heartbeats to the
store, takes over the jobs of lost replicas (a shared store, see ``store``) and deletes expired
jobs. ``stop_accepting`` and ``wait_drained`` make a graceful drain (no new jobs; wait until the
jobs unfinished at that moment have finished and their outcomes have been collected); ``shutdown``
stops the workers, letting queued and running jobs finish within a time limit and cancelling what
is left.
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
from typing import Any

from mineru_fast.serve.errors import ApiError, from_exception
from mineru_fast.serve.store import FINISHED, HEARTBEAT_INTERVAL, JobError, JobRecord, JobStatus, JobStore

logger = logging.getLogger(__name__)

__all__ = ["CostBudget", "Job", "JobManager", "QueueFull", "OverBudget", "ShuttingDown", "AlreadySubmitted"]


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


class AlreadySubmitted(Exception):
    """The store holds a job of the same owner with the same idempotency key (nothing was queued).

    Attributes:
        record: that job's record, as ``JobStore.get`` returns it.
    """

    def __init__(self, record: JobRecord) -> None:
        super().__init__(f"job {record.id} holds this idempotency key")
        self.record = record


class CostBudget:
    """What admitted work holds (bytes of page images, for the service), against a limit;
    thread-safe. The job queue and the chat door take from one budget.

    Args:
        limit: most total cost; None = no limit.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def take(self, cost: int) -> bool:
        """Add ``cost`` if it fits in what the limit leaves; returns whether it was added."""
        with self._lock:
            if self.limit is not None and self._used + cost > self.limit:
                return False
            self._used += cost
            return True

    def add(self, cost: int) -> None:
        """Add ``cost`` whether or not it fits (work admitted already: a take-over)."""
        with self._lock:
            self._used += cost

    def release(self, cost: int) -> None:
        """Give back ``cost`` taken or added before."""
        with self._lock:
            self._used -= cost

    @property
    def used(self) -> int:
        """Total cost held now."""
        with self._lock:
            return self._used

    def room(self) -> int | None:
        """What the limit leaves now (None without a limit)."""
        with self._lock:
            return None if self.limit is None else max(0, self.limit - self._used)


@dataclass(eq=False)
class Job:
    """One parse job as its replica runs it.

    Attributes:
        payload: what the runner needs (released once the job has run).
        owner: API key name that submitted the job (None without keys); only it may read the job.
        request_id: id of the submitting request, for the logs.
        pages_total / pages_done: per-page progress, reported by the runner.
        cost: what the job holds while admitted, counted against the manager's ``max_cost``
            (the service uses decoded pixels).
        retain: record the job in the store, findable by id until ``result_ttl`` after it
            finished; False for a job whose submitter waits for it (its result goes out once).
        claims: the store's claim number this run holds (0 unless taken over from a lost replica).
        idempotency_key / fingerprint: the client's ``Idempotency-Key`` and the digest of its
            request (``JobRecord``), for a retained job; None otherwise.
        result: the runner's JSON-ready result once ``done``.
        error: the ``ApiError`` once ``failed`` or ``cancelled``.
        on_progress: called with the job after each ``report_progress`` (set by the manager).
    """

    payload: Any
    owner: str | None = None
    request_id: str | None = None
    pages_total: int | None = None
    cost: int = 0
    retain: bool = True
    claims: int = 0
    idempotency_key: str | None = None
    fingerprint: str | None = None
    id: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    status: JobStatus = "queued"
    pages_done: int = 0
    result: dict | None = None
    error: ApiError | None = None
    created_at: float = field(default_factory=time.time)
    queued_mono: float = field(default_factory=time.monotonic)
    started_mono: float | None = None
    started_at: float | None = None  # time.time() when a worker took it (JobRecord.started_at)
    on_progress: Callable[[Job], None] | None = field(default=None, repr=False)
    _callbacks: list[Callable[[Job], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def report_progress(self, done: int, total: int) -> None:
        """Record that ``done`` of ``total`` pages are parsed (called from the worker thread)."""
        self.pages_done, self.pages_total = done, total
        if self.on_progress is not None:
            self.on_progress(self)

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
            self.payload = None
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("job done-callback failed", extra={"job_id": self.id})

    def to_record(self, replica: str) -> JobRecord:
        """The job as the store records it, held by ``replica``."""
        return JobRecord(
            id=self.id,
            owner=self.owner,
            replica=replica,
            payload=self.payload,
            cost=self.cost,
            request_id=self.request_id,
            pages_total=self.pages_total,
            pages_done=self.pages_done,
            status=self.status,
            claims=self.claims,
            created_at=self.created_at,
            started_at=self.started_at,  # a job a worker took before its submitter's answer is running
            idempotency_key=self.idempotency_key,
            fingerprint=self.fingerprint,
        )


def _job_error(error: ApiError | None) -> JobError | None:
    return None if error is None else JobError(error.status, error.code, error.message)


class JobManager:
    """Bounded queue + one worker thread per runner + a maintenance thread (heartbeat, take-overs,
    expiry).

    Args:
        runners: one callable per worker, ``runner(job) -> dict`` (the result); it may call
            ``job.report_progress``; exceptions it raises become the job's error.
        max_queued: jobs that may wait; a submission beyond it raises ``QueueFull``.
        store: where retained jobs are recorded (``MemoryJobStore`` for one process, the Ray
            store actor for replicas that share their jobs).
        replica: this manager's id in the store (unique among the replicas sharing it).
        max_cost: most total cost held in ``budget`` (a ``CostBudget``): the jobs queued and
            running, and what other doors take from it (the service's chat images); None = no
            limit.
        on_finish: called as ``on_finish(job, run_seconds)`` after each job, cancelled ones included
            (metrics, logs).
        heartbeat: seconds between the maintenance thread's rounds.

    Raises:
        ValueError: no runner, ``max_queued`` < 1 or ``heartbeat`` <= 0.
    """

    def __init__(
        self,
        runners: list[Callable[[Job], dict]],
        *,
        max_queued: int,
        store: JobStore,
        replica: str = "local",
        max_cost: int | None = None,
        on_finish: Callable[[Job, float], None] | None = None,
        heartbeat: float = HEARTBEAT_INTERVAL,
    ) -> None:
        if not runners or max_queued < 1 or heartbeat <= 0:
            raise ValueError("need at least one runner, max_queued >= 1 and heartbeat > 0")
        self.runners, self.max_queued, self.store, self.replica = runners, max_queued, store, replica
        self.on_finish, self.heartbeat = on_finish, heartbeat
        self.budget = CostBudget(max_cost)
        self._queue: deque[Job] = deque()
        self._held: dict[str, Job] = {}  # retained jobs queued or running here, by id
        self._cond = threading.Condition()
        self._running = 0
        self._accepting = False
        self._awaited: list[Job] = []  # retained jobs unfinished when accepting stopped: drain waits for them
        self._stopping = False
        self._stopped = threading.Event()  # wakes the maintenance thread at shutdown
        self._threads: list[threading.Thread] = []
        self._run_seconds = 1.0  # moving average of job run time, for Retry-After

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker threads and the maintenance thread; jobs are accepted from now on."""
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
        keeper = threading.Thread(target=self._maintain_loop, name="job-maintenance", daemon=True)
        self._threads.append(keeper)
        keeper.start()

    def stop_accepting(self) -> None:
        """Refuse new jobs from now on (``submit`` raises ``ShuttingDown``), and take over no lost
        replica's jobs; the workers go on.

        The retained jobs queued or running here now are those ``drained`` waits to see collected.
        """
        with self._cond:
            if self._accepting:
                self._awaited = list(self._held.values())
            self._accepting = False
            self._cond.notify_all()

    def drained(self) -> bool:
        """True when no job is queued or running here, and each job that was unfinished when
        accepting stopped has been collected (or has expired, or another replica holds it)."""
        with self._cond:
            if self._queue or self._running:
                return False
            awaited = list(self._awaited)
        return all(self._handed_over(job) for job in awaited)

    def _handed_over(self, job: Job) -> bool:
        try:
            record = self.store.get(job.id, job.owner)
        except ApiError:  # the store is gone: nothing can be fetched from it any more
            return True
        return record is None or record.collected or record.replica != self.replica

    def wait_drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until ``drained()``; returns whether it is."""
        deadline = time.monotonic() + timeout
        while not self.drained():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait(timeout=min(0.5, left))  # collection happens in the store: poll it
        return True

    @property
    def cost(self) -> int:
        """Total cost held in the budget: the jobs queued and running (and what other doors took)."""
        return self.budget.used

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
            self.budget.release(sum(job.cost for job in cancelled))
            self._stopping = True
            self._cond.notify_all()
        self._stopped.set()
        for job in cancelled:
            self._end(job, "cancelled", error=ApiError(503, "shutting_down", "the server shut down before the job ran"))
            logger.warning("job cancelled by shutdown", extra={"job_id": job.id, "request_id": job.request_id})
            if self.on_finish is not None:
                self.on_finish(job, 0.0)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        return cancelled

    # -- submission and lookup -------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job (a retained one is recorded in the store first; this may block briefly).

        Raises:
            ShuttingDown: the manager is not accepting jobs.
            QueueFull: ``max_queued`` jobs are already waiting.
            OverBudget: the job's cost does not fit in what ``max_cost`` leaves now.
            AlreadySubmitted: the store holds a job of ``job.owner`` with ``job.idempotency_key``
                (stored by another request since the caller looked, e.g. on another replica).
            ApiError: the store could not be reached (``503``).
        """
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is not accepting jobs")
            if len(self._queue) >= self.max_queued:
                raise QueueFull(self._retry_after_locked())
            if not self.budget.take(job.cost):
                raise OverBudget(self._retry_after_locked())
            try:
                if job.retain and (stored := self.store.add(job.to_record(self.replica))) is not None:
                    raise AlreadySubmitted(stored)
            except BaseException:
                self.budget.release(job.cost)
                raise
            self._enqueue_locked(job)
        return job

    def _enqueue_locked(self, job: Job) -> None:
        job.queued_mono = time.monotonic()
        self._queue.append(job)
        if job.retain:
            job.on_progress = self._report_progress
            self._held[job.id] = job
        self._cond.notify_all()

    def queue_position(self, job_id: str) -> int | None:
        """1-based position of a job queued here (1 = next to run), None if it is not queued here."""
        with self._cond:
            for position, queued in enumerate(self._queue, start=1):
                if queued.id == job_id:
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

    def _retry_after_locked(self) -> int:
        ahead = len(self._queue) + self._running
        return max(1, min(120, math.ceil(self._run_seconds * ahead / len(self.runners))))

    # -- the store -------------------------------------------------------------------------------
    def _record(self, job: Job, **changes: Any) -> bool:
        """Mirror a change of a retained job into the store; False when the store refused it (the
        job was taken over by another replica, or expired). A store that cannot be reached is
        logged and counts as accepted: the replica goes on with the job."""
        try:
            return self.store.update(job.id, job.claims, **changes)
        except ApiError:
            logger.warning("job store unreachable; job state not recorded", extra={"job_id": job.id})
            return True

    def _report_progress(self, job: Job) -> None:
        self._record(job, pages_done=job.pages_done, pages_total=job.pages_total)

    def _end(self, job: Job, status: JobStatus, result: dict | None = None, error: ApiError | None = None) -> None:
        """Finish a job: in the store (retained jobs) and for its local waiters."""
        if job.retain and not self._record(job, status=status, result=result, error=_job_error(error)):
            logger.warning("job outcome dropped: another replica holds the job", extra={"job_id": job.id})
        with self._cond:
            self._held.pop(job.id, None)
        job._finish(status, result, error)

    # -- workers ---------------------------------------------------------------------------------
    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._queue:
                return None
            job = self._queue.popleft()
            job.status, job.started_mono, job.started_at = "running", time.monotonic(), time.time()
            self._running += 1
            return job

    def _work(self, index: int, runner: Callable[[Job], dict]) -> None:
        while (job := self._next()) is not None:
            start = time.monotonic()
            if job.retain and not self._record(job, status="running"):
                logger.warning("job skipped: another replica holds it, or it expired", extra={"job_id": job.id})
                with self._cond:
                    self._held.pop(job.id, None)
                    self._running -= 1
                    self.budget.release(job.cost)
                    self._cond.notify_all()
                continue
            try:
                result = runner(job)
            except Exception as exc:  # one job fails alone; the worker goes on
                error = from_exception(exc)
                if error.status >= 500:
                    logger.exception("job crashed", extra={"job_id": job.id, "request_id": job.request_id})
                self._end(job, "failed", error=error)
            else:
                self._end(job, "done", result=result)
            seconds = time.monotonic() - start
            with self._cond:
                self._running -= 1
                self.budget.release(job.cost)
                self._run_seconds = 0.8 * self._run_seconds + 0.2 * seconds
                self._cond.notify_all()
            if self.on_finish is not None:
                try:
                    self.on_finish(job, seconds)
                except Exception:
                    logger.exception("on_finish hook failed", extra={"job_id": job.id})
            logger.debug("worker %d idle", index, extra={"worker": index})

    # -- maintenance -----------------------------------------------------------------------------
    def maintain(self) -> list[Job]:
        """One maintenance round: heartbeat, take over lost replicas' jobs while accepting (as many
        as the queue and the cost budget have room for), delete expired jobs.

        Returns:
            The jobs taken over, now queued here.

        Raises:
            ApiError: the store could not be reached (``503``).
        """
        with self._cond:
            room = self.max_queued - len(self._queue) if self._accepting else 0
        taken: list[Job] = []
        for record in self.store.claim(self.replica, max(0, room), self.budget.room()):
            job = Job(
                payload=record.payload,
                owner=record.owner,
                request_id=record.request_id,
                pages_total=record.pages_total,
                cost=record.cost,
                claims=record.claims,
                id=record.id,
                created_at=record.created_at,
            )
            self.budget.add(job.cost)  # claimed within the room read above
            with self._cond:
                self._enqueue_locked(job)
            logger.warning("job taken over from a lost replica", extra={"job_id": job.id, "request_id": job.request_id})
            taken.append(job)
        self.store.expire()
        return taken

    def _maintain_loop(self) -> None:
        while True:
            try:
                self.maintain()
            except ApiError:
                logger.warning("job store unreachable (heartbeat)")
            except Exception:
                logger.exception("job maintenance failed")
            if self._stopped.wait(timeout=self.heartbeat):
                return
