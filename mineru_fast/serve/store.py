"""Where the service keeps its asynchronous jobs: the ``JobStore`` interface and ``MemoryJobStore``.

A job submitted with ``POST /v1/jobs`` is queued and run by the replica that accepted it (its
``JobManager``), but its record lives in a job store, so that any replica can answer its status and
result. ``mineru-fast serve`` keeps the store in its own memory (``MemoryJobStore``); under Ray
Serve the same class runs as one actor shared by every replica of the application
(``mineru_fast.distributed.job_store``), which serializes the calls, so each method is atomic.

Each record holds the upload (``payload``) until the job ends. Replicas heartbeat with ``claim``:
a queued or running job whose replica has not heartbeated for ``lost_after`` seconds is handed to
the next replica that claims, which runs it again from the stored upload under the same id. Every
change a replica makes names the claim it holds (``claims``), so a replica that lost the job to
another cannot change it any more, and a job ends once, with one result. After ``max_claims``
take-overs a job whose replica is lost again ends ``failed`` with the code ``replica_lost``.
A finished job is kept ``result_ttl`` seconds, then deleted; only the API key that submitted a job
may read it. A job submitted with an idempotency key (the ``Idempotency-Key`` header) is the only
one of its owner with that key until it is deleted: ``add`` hands back the stored job instead of
storing a second one, in the same atomic step, so two replicas given one key make one job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

__all__ = [
    "JobStatus",
    "FINISHED",
    "JobError",
    "JobRecord",
    "JobStore",
    "MemoryJobStore",
    "HEARTBEAT_INTERVAL",
    "OWNER_LOST_AFTER",
    "MAX_CLAIMS",
]

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
FINISHED: tuple[JobStatus, ...] = ("done", "failed", "cancelled")

HEARTBEAT_INTERVAL = 2.0
"""Seconds between a replica's heartbeats (``JobManager``)."""
OWNER_LOST_AFTER = 12.0
"""Seconds without a heartbeat after which a replica's unfinished jobs are taken over."""
MAX_CLAIMS = 2
"""Take-overs of one job at most; a job whose replica is lost once more ends ``replica_lost``."""


@dataclass(frozen=True)
class JobError:
    """Why a job ended ``failed`` or ``cancelled`` (the service's ``ApiError`` as plain data).

    Attributes:
        status: HTTP status the result request answers with.
        code: stable error code, e.g. ``"corrupt_document"``.
        message: a sentence for people.
    """

    status: int
    code: str
    message: str


@dataclass
class JobRecord:
    """What the store knows of one job.

    Attributes:
        id: the job id.
        owner: API key name that submitted it (None without keys); only it may read the job.
        replica: id of the replica that holds the job (queued or running there).
        payload: the upload and its options until the job ends; None in records ``get`` returns.
        cost: what the job holds while admitted (``JobManager.max_cost``).
        request_id: id of the submitting request, for the logs.
        pages_total / pages_done: per-page progress.
        status: ``queued``, ``running``, ``done``, ``failed`` or ``cancelled``.
        claims: times a surviving replica took the job over from a lost one.
        result: the JSON-ready result once ``done`` (in records ``get`` returns only when asked).
        error: the ``JobError`` once ``failed`` or ``cancelled``.
        collected: its outcome has been handed to a client.
        created_at / started_at / finished_at: Unix times (seconds).
        idempotency_key: the client's ``Idempotency-Key`` (None without one); unique among the
            stored jobs of one ``owner``.
        fingerprint: digest of what the submission asked for (``ParseRequest.fingerprint``), to
            tell a repeat of it from another request under the same key; None without a key.
    """

    id: str
    owner: str | None
    replica: str
    payload: Any = field(default=None, repr=False)
    cost: int = 0
    request_id: str | None = None
    pages_total: int | None = None
    pages_done: int = 0
    status: JobStatus = "queued"
    claims: int = 0
    result: dict | None = field(default=None, repr=False)
    error: JobError | None = None
    collected: bool = False
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    idempotency_key: str | None = None
    fingerprint: str | None = None

    def describe(self, queue_position: int | None = None) -> dict:
        """The job's status as JSON-ready data (no result).

        Args:
            queue_position: 1-based place in its replica's queue, when known.

        Returns:
            ``job_id``, ``status``, ``pages`` (``total``, ``done``), ``attempts`` (runs started,
            take-overs included), the times, ``queue_position`` if given, ``error`` once failed.
        """
        out: dict[str, Any] = {
            "job_id": self.id,
            "status": self.status,
            "pages": {"total": self.pages_total, "done": self.pages_done},
            "attempts": self.claims + 1,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }
        if queue_position is not None:
            out["queue_position"] = queue_position
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.message}
        return out


class JobStore(Protocol):
    """The operations the service's ``JobManager`` needs of a job store (see the module's text)."""

    def add(self, record: JobRecord) -> JobRecord | None:
        """Store a new queued job held by ``record.replica`` (a sign of life of that replica) and
        return None; when a stored job of ``record.owner`` has ``record.idempotency_key`` already,
        store nothing and return that job's record (as ``get`` does)."""

    def find(self, owner: str | None, idempotency_key: str) -> JobRecord | None:
        """The stored job of ``owner`` submitted with ``idempotency_key`` (as ``get`` returns
        it); None when there is none (never was, or expired)."""

    def update(
        self,
        job_id: str,
        claims: int,
        *,
        status: JobStatus | None = None,
        pages_done: int | None = None,
        pages_total: int | None = None,
        result: dict | None = None,
        error: JobError | None = None,
    ) -> bool:
        """Change a job held under claim number ``claims``; False when the store refused: the job
        is unknown or expired, another replica took it over, or it has ended already."""

    def get(self, job_id: str, owner: str | None, *, with_result: bool = False) -> JobRecord | None:
        """The job's record without its payload (and without its result unless ``with_result``);
        None when it is unknown, expired, or another key's."""

    def collect(self, job_id: str) -> None:
        """Record that the job's outcome has been handed to a client."""

    def claim(self, replica: str, max_jobs: int, max_cost: int | None) -> list[JobRecord]:
        """Heartbeat of ``replica``, and the lost replicas' jobs it now holds (with payloads)."""

    def expire(self) -> int:
        """Delete the jobs finished ``result_ttl`` seconds ago or more; how many."""


class MemoryJobStore:
    """``JobStore`` in one process's memory (thread-safe); also the state of the Ray store actor.

    Args:
        result_ttl: seconds a finished job is kept.
        lost_after: seconds without a heartbeat after which a replica counts as lost.
        max_claims: take-overs of one job at most.
        clock: monotonic clock in seconds (injectable for tests).

    Raises:
        ValueError: a bound that is not positive (``max_claims`` may be 0: no take-over).
    """

    def __init__(
        self,
        result_ttl: float,
        *,
        lost_after: float = OWNER_LOST_AFTER,
        max_claims: int = MAX_CLAIMS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if result_ttl <= 0 or lost_after <= 0 or max_claims < 0:
            raise ValueError("result_ttl and lost_after must be > 0, max_claims >= 0")
        self.result_ttl, self.lost_after, self.max_claims, self.clock = result_ttl, lost_after, max_claims, clock
        self._records: dict[str, JobRecord] = {}  # in submission order
        self._finished: dict[str, float] = {}  # job id -> clock() when it ended
        self._seen: dict[str, float] = {}  # replica id -> clock() of its last sign of life
        self._keys: dict[tuple[str | None, str], str] = {}  # (owner, idempotency key) -> job id
        self._lock = threading.Lock()

    def add(self, record: JobRecord) -> JobRecord | None:
        """See ``JobStore.add``.

        Raises:
            ValueError: a job with this id is stored already.
        """
        with self._lock:
            if record.id in self._records:
                raise ValueError(f"job {record.id} is stored already")
            if record.idempotency_key is not None:
                scope = (record.owner, record.idempotency_key)
                if scope in self._keys:
                    return _view(self._records[self._keys[scope]])
                self._keys[scope] = record.id
            self._records[record.id] = record
            self._seen[record.replica] = self.clock()
            return None

    def find(self, owner: str | None, idempotency_key: str) -> JobRecord | None:
        """See ``JobStore.find``."""
        with self._lock:
            job_id = self._keys.get((owner, idempotency_key))
            return None if job_id is None else _view(self._records[job_id])

    def update(
        self,
        job_id: str,
        claims: int,
        *,
        status: JobStatus | None = None,
        pages_done: int | None = None,
        pages_total: int | None = None,
        result: dict | None = None,
        error: JobError | None = None,
    ) -> bool:
        """See ``JobStore.update``; ``status`` ``running`` sets ``started_at``, a finished one
        ``finished_at``, the result or error, and drops the payload."""
        with self._lock:
            record = self._records.get(job_id)
            if record is None or record.claims != claims or record.status in FINISHED:
                return False
            if pages_done is not None:
                record.pages_done = pages_done
            if pages_total is not None:
                record.pages_total = pages_total
            if status == "running":
                record.status, record.started_at = status, time.time()
            elif status is not None:
                self._end(record, status, result, error)
            return True

    def _end(self, record: JobRecord, status: JobStatus, result: dict | None, error: JobError | None) -> None:
        record.status, record.result, record.error = status, result, error
        record.finished_at, record.payload = time.time(), None
        self._finished[record.id] = self.clock()

    def get(self, job_id: str, owner: str | None, *, with_result: bool = False) -> JobRecord | None:
        """See ``JobStore.get``."""
        with self._lock:
            record = self._records.get(job_id)
            if record is None or record.owner != owner:
                return None
            return _view(record, with_result)

    def collect(self, job_id: str) -> None:
        """See ``JobStore.collect``."""
        with self._lock:
            record = self._records.get(job_id)
            if record is not None:
                record.collected = True

    def claim(self, replica: str, max_jobs: int, max_cost: int | None) -> list[JobRecord]:
        """See ``JobStore.claim``: takes over, oldest first, at most ``max_jobs`` jobs of lost
        replicas whose costs sum to at most ``max_cost`` (None: no bound); a lost job that was
        taken over ``max_claims`` times already ends ``failed`` (``replica_lost``) instead.

        Returns:
            Copies of the records taken over, payloads included, each queued on ``replica`` with
            its ``claims`` raised by one.
        """
        with self._lock:
            now = self.clock()
            self._seen[replica] = now
            claimed: list[JobRecord] = []
            budget = max_cost
            for record in self._records.values():
                if record.status in FINISHED or now - self._seen.get(record.replica, now) <= self.lost_after:
                    continue
                if record.claims >= self.max_claims:
                    message = f"the replica running the job was lost {record.claims + 1} times; submit it again"
                    self._end(record, "failed", None, JobError(500, "replica_lost", message))
                    continue
                if len(claimed) >= max_jobs or (budget is not None and record.cost > budget):
                    continue
                if budget is not None:
                    budget -= record.cost
                record.replica, record.claims, record.status = replica, record.claims + 1, "queued"
                record.started_at, record.pages_done = None, 0
                claimed.append(replace(record))
            return claimed

    def expire(self) -> int:
        """See ``JobStore.expire``; also forgets lost replicas that hold no job."""
        with self._lock:
            now = self.clock()
            expired = [job_id for job_id, ended in self._finished.items() if now - ended >= self.result_ttl]
            for job_id in expired:
                record = self._records.pop(job_id)
                del self._finished[job_id]
                if record.idempotency_key is not None:
                    del self._keys[(record.owner, record.idempotency_key)]
            holding = {record.replica for record in self._records.values() if record.status not in FINISHED}
            for replica, seen in list(self._seen.items()):
                if now - seen > self.lost_after and replica not in holding:
                    del self._seen[replica]
            return len(expired)


def _view(record: JobRecord, with_result: bool = False) -> JobRecord:
    """A copy of a stored record as lookups return it: no payload, the result only if asked for."""
    return replace(record, payload=None, result=record.result if with_result else None)
