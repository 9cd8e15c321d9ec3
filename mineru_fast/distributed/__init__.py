"""Scale-out on Ray (extra ``mineru-fast[ray]``): ``mineru-fast batch`` and the Ray Serve service.

- ``worker``: ``DocumentWorker``, one parser per Ray actor; parses a document into a temporary
  directory and streams its output files page by page (no Ray import: testable without Ray).
- ``manifest``: the batch manifest (JSON lines), and which documents a resumed run skips.
- ``batch``: the batch driver (``run_batch``): actors, bounded retries, atomic outputs, progress.
- ``serve_app``: the service's FastAPI application as a Ray Serve deployment.
- ``job_store``: the job store its replicas share (a Serve deployment-scoped actor).

Importing this package needs no Ray; ``batch``, ``serve_app`` and ``job_store`` import it and raise
``RayDependencyError`` when it is missing.
"""

from __future__ import annotations

from ..errors import MineruFastError

__all__ = ["RayDependencyError", "require_ray"]


class RayDependencyError(MineruFastError):
    """Ray (the ``ray`` extra) is not installed."""


def require_ray() -> None:
    """Check that Ray with its Data and Serve libraries imports.

    Raises:
        RayDependencyError: it does not; the message names the install command.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise RayDependencyError("scale-out needs Ray: pip install 'mineru-fast[ray]'")
