"""Scale-out on Ray (extra ``mineru-fast[ray]``): ``mineru-fast batch`` and the Ray Serve service.

- ``worker``: ``inspect_document`` (a document's selected pages) and ``DocumentWorker``, one parser
  per batch actor: parses a document's pages (all, or a task's range) and hands each page back with
  its image files (no Ray import: testable without Ray).
- ``manifest``: the batch manifest (JSON lines), and which documents a resumed run skips.
- ``sources``: the batch inputs: local paths, directories and globs, pyarrow filesystem URIs.
- ``placement``: NUMA-local actors (which cores each actor pins itself to).
- ``assembly``: a document's page-range tasks and its outputs, written in page order from them.
- ``batch``: the batch (``run_batch``): a Ray Data pipeline (inspection tasks, an actor pool of
  parsers), bounded retries, atomic outputs written by the driver, progress.
- ``serve_app``: the service's FastAPI application as a Ray Serve deployment.
- ``job_store``: the job store its replicas share (a Serve deployment-scoped actor).

Importing this package needs no Ray; ``batch``, ``serve_app`` and ``job_store`` import it and raise
``RayDependencyError`` when it is missing.
"""

from __future__ import annotations

import os

from mineru_fast.errors import MineruFastError
from mineru_fast.runtime.hub import PREPARED_CACHE_ENV

__all__ = ["PAGES_PER_TASK", "RayClusterUnreachable", "RayDependencyError", "init_ray", "require_ray"]

PAGES_PER_TASK = 32
"""Default of ``mineru-fast batch --pages-per-task``: a document with more selected pages is split
into tasks of this many pages."""


class RayDependencyError(MineruFastError):
    """Ray (the ``ray`` extra) is not installed."""

    code = "missing_dependency"


def require_ray() -> None:
    """Check that Ray with its Data and Serve libraries imports.

    Raises:
        RayDependencyError: it does not; the message names the install command.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise RayDependencyError("scale-out needs Ray: pip install 'mineru-fast[ray]'")


class RayClusterUnreachable(MineruFastError):
    """``--ray-address`` names no Ray cluster this process can join (``auto`` with none running)."""

    code = "ray_unreachable"


def init_ray(address: str | None, log_to_driver: bool = True, num_cpus: int | None = None) -> None:
    """Start Ray for this process: without ``address`` a new local Ray (``address="local"``: never
    a cluster found through ``RAY_ADDRESS`` or a running ``ray start``, which Ray would join, and
    joining one with ``num_cpus`` set is an error in Ray) of ``num_cpus`` CPUs (None: Ray counts
    them); with one, that cluster, its refusal as one typed error instead of Ray's traceback.

    Raises:
        RayClusterUnreachable: Ray found no cluster at ``address`` (its ``ConnectionError``).
    """
    import ray

    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver)
        return
    # A local Ray's workers inherit this environment; a cluster's get the prepared-cache switch
    # (--no-prepared-cache sets it) from the job's runtime environment.
    shared = {name: os.environ[name] for name in (PREPARED_CACHE_ENV,) if name in os.environ}
    try:
        ray.init(address=address, log_to_driver=log_to_driver, runtime_env={"env_vars": shared} if shared else None)
    except ConnectionError as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise RayClusterUnreachable(f"cannot join the Ray cluster at {address!r}: {reason}") from exc
