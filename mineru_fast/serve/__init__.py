"""``mineru-fast serve``: an HTTP service around ``DocumentParser`` (extra ``mineru-fast[serve]``).

The service loads the model once, checks its engine with a small image (ready in seconds), parses a
canary page before or after becoming ready (or not), and parses uploads in a bounded pool of worker
threads, never on the event loop. Modules, one concern each:

- ``config``: ``ServeConfig``, the service's validated settings.
- ``errors``: ``ApiError`` and the one JSON error format; mapping of mineru-fast exceptions.
- ``logs``: JSON-lines logging (never document contents).
- ``security``: API keys, per-key token-bucket rate limits, the streaming upload-size limit.
- ``jobs``: the bounded job queue, worker threads, heartbeat and take-over of lost replicas' jobs.
- ``store``: the ``JobStore`` interface of job records (status, result TTL, key isolation, claims)
  and ``MemoryJobStore``.
- ``parsing``: request checks, the parse run with per-page progress, result rendering, the canary.
- ``startup``: the engine check that readiness waits for, and the canary page's state.
- ``service``: the model, the workers and the service's state (start-up, readiness, drain).
- ``admission``: an upload checked and queued as a job (every door that parses documents).
- ``bundle``: a job parsed into MinerU 4's result bundle (MinerU's document API's outputs).
- ``mineru_api``: MinerU 4's v1 document API (uploads, parse jobs, files, tasks, ``file_parse``);
  ``mineru_files``: its uploads and source files, in memory.
- ``metrics``: Prometheus metrics.
- ``app``: the FastAPI application factory ``create_app``.
- ``server``: ``serve(config)``, which runs the application under uvicorn.

Importing ``mineru_fast.serve`` needs none of the extra's packages; ``create_app`` and ``serve``
import them on first use and raise ``ServeDependencyError`` when they are missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mineru_fast.errors import MineruFastError
from mineru_fast.serve.config import ServeConfig

if TYPE_CHECKING:
    from mineru_fast.serve.app import create_app as create_app
    from mineru_fast.serve.server import serve as serve

__all__ = ["ServeConfig", "ServeDependencyError", "create_app", "serve", "require_serve_dependencies"]

_REQUIRED = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "multipart": "python-multipart",
}


class ServeDependencyError(MineruFastError):
    """A package of the ``serve`` extra is not installed."""

    code = "missing_dependency"


def require_serve_dependencies() -> None:
    """Check that the ``serve`` extra's packages import.

    Raises:
        ServeDependencyError: one or more are missing; the message names them and the install command.
    """
    import importlib.util

    missing = [dist for module, dist in _REQUIRED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ServeDependencyError(f"the HTTP service needs {', '.join(missing)}: pip install 'mineru-fast[serve]'")


def __getattr__(name: str) -> Any:
    """Import ``create_app`` and ``serve`` lazily, after checking the extra is installed."""
    if name == "create_app":
        require_serve_dependencies()
        from mineru_fast.serve.app import create_app

        return create_app
    if name == "serve":
        require_serve_dependencies()
        from mineru_fast.serve.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
