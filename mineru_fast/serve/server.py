"""``serve(config)``: run the service under uvicorn (import it through ``mineru_fast.serve``, which
checks that the ``serve`` extra is installed) until SIGINT/SIGTERM, then drain and stop.

Graceful drain: on the first SIGTERM (or SIGINT) the service stops admitting jobs (``503``,
``/ready`` too) but goes on answering everything else, status and result requests included,
until every queued and running job has finished and its outcome has been collected by its client,
or ``drain_timeout`` seconds have passed. Then uvicorn stops accepting connections, lets open
requests finish (within what is left of ``drain_timeout``), and the application stops its workers
(jobs still queued then are cancelled and logged). A signal while the model is still loading, or
before the server runs at all, stops it at once; a second signal ends the drain early.

Connections get a header deadline, a cap, a write timeout and a cap on unread response bytes
(``connections``); asyncio's accept-error lines are rate-limited.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from mineru_fast.serve.config import ServeConfig
from mineru_fast.serve.connections import ACCEPT_ERROR_PREFIX, RateLimitedLogFilter, connection_limits, guarded_protocol
from mineru_fast.serve.logs import configure_logging, uvicorn_log_config

if TYPE_CHECKING:  # the service imports the parser and torch: only once the signal handlers are in place
    from mineru_fast.serve.service import Service

logger = logging.getLogger(__name__)

__all__ = ["serve"]


class _ExitSignals:
    """SIGINT/SIGTERM from the start of ``serve`` on: recorded until the uvicorn server exists,
    then passed to it (uvicorn installs its own handlers only while it runs)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.server: Any = None

    def handle(self, sig: int, frame: FrameType | None) -> None:
        if self.server is not None:
            self.server.handle_exit(sig, frame)
        else:
            self.received.append(sig)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_ExitSignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(config: ServeConfig) -> int:
    """Run the HTTP service in the foreground.

    Args:
        config: the service settings.

    Returns:
        Exit status: 0 after a clean shutdown (SIGINT or SIGTERM, at any moment), 2 when the model
        failed to load, the engine check failed or the canary failed (after the service became
        ready: once the jobs in flight are done and collected, within ``drain_timeout``), 1 when
        uvicorn could not start (e.g. the port is taken).
        Threads still loading the model or parsing when this returns cannot be stopped: a process
        should end promptly (the CLI ends with ``os._exit``, see ``command.run_serve_command``).

    Raises:
        ValueError: the API key file is unreadable or malformed.
    """
    with _ExitSignals().installed() as signals:
        configure_logging(config.log_level)
        logger.info("loading the application")
        from mineru_fast.serve.app import create_app

        logging.getLogger("asyncio").addFilter(RateLimitedLogFilter(ACCEPT_ERROR_PREFIX, interval=10.0))
        failure: list[BaseException] = []
        server: DrainingServer | None = None

        def load_failed(exc: BaseException) -> None:
            failure.append(exc)
            if server is not None:
                server.should_exit = True

        app = create_app(config, on_load_failure=load_failed)
        max_connections, backlog = connection_limits(config.max_connections)
        uv_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=guarded_protocol(
                config.header_timeout,
                max_connections,
                config.write_timeout,
                config.min_body_rate,
                config.max_response_buffer_bytes,
            ),
            backlog=backlog,
            log_config=uvicorn_log_config(config.log_level),
            access_log=False,
            timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout)),
            timeout_keep_alive=5,
            server_header=False,
            lifespan="on",
        )
        server = DrainingServer(uv_config, app.state.service)
        signals.server = server
        if signals.received:
            logger.info("stopped before start", extra={"code": "signal"})
            return 0
        logger.info("starting", extra={"host": config.host, "port": config.port, "limit": max_connections})
        server.run()
    if failure:
        return 2
    return 0 if server.started or server.signalled else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first exit signal drains the service before it stops.

    Args:
        config: the ``uvicorn.Config``.
        service: the application's ``Service``.
    """

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.signalled = False
        self._drain_requested = False
        self._drain_started = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain (started from the event loop, see ``on_tick``); later ones: stop now."""
        self.signalled = True
        if self._drain_requested or self.should_exit:
            super().handle_exit(sig, frame)
        else:
            self._drain_requested = True  # a signal handler does no more: the lock it would need may be held

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), which also starts a requested drain."""
        if self._drain_requested and not self._drain_started:
            self._drain_started = True
            if self.service.begin_drain():
                threading.Thread(target=self._drain, name="drain", daemon=True).start()
            else:  # still loading, or failed: nothing to wait for
                self.should_exit = True
        return await super().on_tick(counter)

    def _drain(self) -> None:
        start = time.monotonic()
        drained = self.service.wait_drained()
        seconds = time.monotonic() - start
        logger.info("drained" if drained else "drain timed out", extra={"seconds": round(seconds, 3)})
        left = self.service.config.drain_timeout - seconds
        self.config.timeout_graceful_shutdown = max(1, math.ceil(left))  # open requests get what is left
        self.should_exit = True
