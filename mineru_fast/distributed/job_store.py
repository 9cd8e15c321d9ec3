"""The job store shared by the replicas of one Ray Serve application.

One ``MemoryJobStore`` runs as a Serve deployment-scoped actor (``job_store_actor``): Serve's
controller starts it before the replicas, recreates it if it fails its health checks, and deletes
it with the application. A Ray actor runs one call at a time, so each store operation (a claim of
a lost replica's job, or the check of an idempotency key as it adds a job, above all) is atomic
across replicas. Each replica reaches it through ``RayJobStore``, the ``JobStore`` interface over
actor calls. The records live in that actor's memory: if the actor is lost (its node goes), the
jobs it held are lost with it and their ids answer ``404`` (clients submit again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError
from ray.serve.config import DeploymentActorConfig

from mineru_fast.serve.errors import ApiError
from mineru_fast.serve.store import JobError, JobRecord, JobStatus, MemoryJobStore

__all__ = ["JOB_STORE_ACTOR", "RayJobStore", "job_store_actor"]

JOB_STORE_ACTOR = "jobs"
"""Name of the store among the deployment's actors (``serve.get_deployment_actor``)."""
CALL_TIMEOUT = 30.0  # seconds one store call may take before the request gets 503


def job_store_actor(result_ttl: float) -> DeploymentActorConfig:
    """The deployment-actor declaration of the shared store (no CPU reserved: it only holds records).

    Args:
        result_ttl: seconds a finished job is kept (``ServeConfig.result_ttl``).

    Returns:
        The entry for ``deployment_actors`` of the Serve deployment.
    """
    return DeploymentActorConfig(
        name=JOB_STORE_ACTOR,
        actor_class=ray.remote(MemoryJobStore),
        init_kwargs={"result_ttl": result_ttl},
        actor_options={"num_cpus": 0},
    )


def _deployment_store() -> Any:
    return serve.get_deployment_actor(JOB_STORE_ACTOR)


class RayJobStore:
    """``JobStore`` whose operations run in the shared store actor (see the module's text).

    Args:
        connect: returns the actor's handle; default ``serve.get_deployment_actor`` (inside a
            replica). Called again after the actor was recreated.
        timeout: seconds one call may take.

    Every method raises ``ApiError`` ``503 job_store_unavailable`` (with ``Retry-After``) when the
    actor cannot be reached: not registered yet, dead and not yet recreated, or too slow.
    """

    def __init__(self, connect: Callable[[], Any] = _deployment_store, timeout: float = CALL_TIMEOUT) -> None:
        self._connect, self.timeout = connect, timeout
        self._actor: Any = None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        problem: Exception | None = None
        for _ in range(2):  # a handle to a recreated actor is stale: look it up once more
            try:
                actor = self._actor if self._actor is not None else self._connect()
            except ValueError as exc:  # not registered (yet, or again)
                problem = exc
                break
            self._actor = actor
            try:
                return ray.get(getattr(actor, method).remote(*args, **kwargs), timeout=self.timeout)
            except RayActorError as exc:
                self._actor, problem = None, exc
            except GetTimeoutError as exc:
                problem = exc
                break
        raise ApiError(
            503, "job_store_unavailable", "the job store cannot be reached; retry shortly", {"Retry-After": "5"}
        ) from problem

    def add(self, record: JobRecord) -> JobRecord | None:
        """See ``JobStore.add`` (one actor call: atomic across replicas)."""
        stored: JobRecord | None = self._call("add", record)
        return stored

    def find(self, owner: str | None, idempotency_key: str) -> JobRecord | None:
        """See ``JobStore.find``."""
        found: JobRecord | None = self._call("find", owner, idempotency_key)
        return found

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
        """See ``JobStore.update``."""
        changes = {"status": status, "pages_done": pages_done, "pages_total": pages_total, "result": result}
        return bool(self._call("update", job_id, claims, error=error, **changes))

    def get(self, job_id: str, owner: str | None, *, with_result: bool = False) -> JobRecord | None:
        """See ``JobStore.get``."""
        found: JobRecord | None = self._call("get", job_id, owner, with_result=with_result)
        return found

    def collect(self, job_id: str) -> None:
        """See ``JobStore.collect``."""
        self._call("collect", job_id)

    def claim(self, replica: str, max_jobs: int, max_cost: int | None) -> list[JobRecord]:
        """See ``JobStore.claim``."""
        claimed: list[JobRecord] = self._call("claim", replica, max_jobs, max_cost)
        return claimed

    def expire(self) -> int:
        """See ``JobStore.expire``."""
        return int(self._call("expire"))
