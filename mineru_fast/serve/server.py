"""``serve(config)``: run the service under uvicorn until SIGINT/SIGTERM.

Graceful shutdown: on the signal uvicorn stops accepting connections and waits (up to
``drain_timeout``) for open requests, including synchronous parses, to be answered; then the
application's lifespan drains the job queue (queued and running jobs finish, within
``drain_timeout``; what is left is cancelled and logged) and the process exits.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

from .config import ServeConfig
from .logs import configure_logging, uvicorn_log_config

logger = logging.getLogger(__name__)

__all__ = ["serve"]


def serve(config: ServeConfig) -> int:
    """Run the HTTP service in the foreground.

    Args:
        config: the service settings.

    Returns:
        Exit status: 0 after a clean shutdown (SIGINT or SIGTERM), 2 when the model failed to load or the canary
        failed, 1 when uvicorn could not start (e.g. the port is taken).

    Raises:
        ServeDependencyError: the ``serve`` extra is not installed.
        ValueError: the API key file is unreadable or malformed.
    """
    from . import require_serve_dependencies

    require_serve_dependencies()
    import uvicorn

    from .app import create_app

    configure_logging(config.log_level)
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load_failed(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_load_failure=load_failed)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=uvicorn_log_config(config.log_level),
        access_log=False,
        timeout_graceful_shutdown=int(config.drain_timeout) or None,
        timeout_keep_alive=5,
        server_header=False,
        lifespan="on",
    )
    server = uvicorn.Server(uv_config)
    logger.info("starting", extra={"host": config.host, "port": config.port})
    with _signals_end_gracefully():
        server.run()
    if failure:
        return 2
    return 0 if server.started else 1


@contextlib.contextmanager
def _signals_end_gracefully() -> Iterator[None]:
    """While uvicorn runs, SIGINT/SIGTERM are its own (graceful shutdown). Afterwards it raises the
    caught signal again for the handler that was there before; a no-op handler placed here takes
    it, so a clean shutdown ends with exit status 0 rather than death by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
