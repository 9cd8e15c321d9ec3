"""Per-request context: request id, access log line, request metrics, last-resort error answer.

``RequestContextMiddleware`` is the outermost layer of the application, so every response,
including refusals by the guard and crashes, carries ``X-Request-ID`` and is logged and counted.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from mineru_fast.serve.metrics import ServiceMetrics, method_label, route_label
from mineru_fast.serve.security import ASGIApp, Message, Receive, Scope, Send, send_error

logger = logging.getLogger(__name__)

__all__ = ["RequestContextMiddleware", "REQUEST_ID_HEADER"]

REQUEST_ID_HEADER = "X-Request-ID"
PROBES = ("/health", "/ready")  # polled every few seconds by load balancers and orchestrators
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _incoming_id(scope: Scope) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"x-request-id":
            text = value.decode("latin-1")
            return text if _VALID_ID.match(text) else None
    return None


class RequestContextMiddleware:
    """ASGI middleware giving each HTTP request an id, a JSON log line and metrics.

    A valid incoming ``X-Request-ID`` (1-128 of ``A-Za-z0-9._:-``) is kept, else a new one is
    made. The id is put in ``scope["state"]["request_id"]`` and in the response header. An
    exception escaping the application is logged and answered with a JSON ``500`` when no
    response has started. A probe (``PROBES``) answered below ``400`` is logged at ``DEBUG``,
    every other request at ``INFO`` (a load balancer's polling would otherwise fill the log).

    Args:
        app: the wrapped ASGI application.
        metrics: where requests are counted.
    """

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_id(scope) or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500
        started = False
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error", extra={"request_id": request_id})
            if not started:
                await send_error(send_with_id, scope, 500, "internal_error", "the server failed; see its logs")
        finally:
            seconds = time.perf_counter() - start
            self.metrics.observe_request(scope["path"], scope["method"], status, seconds)
            probe = scope["path"] in PROBES and status < 400
            logger.log(
                logging.DEBUG if probe else logging.INFO,
                "request",
                extra={
                    "request_id": request_id,
                    "method": method_label(scope["method"]),
                    "route": route_label(scope["path"]),
                    "status": status,
                    "duration_ms": round(seconds * 1000, 2),
                    "key": state.get("api_key"),
                },
            )
