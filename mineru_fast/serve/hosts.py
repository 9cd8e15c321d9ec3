"""``HostCheckMiddleware``: the ``Host`` allow-list and the same-origin rule for browsers.

Without API keys a local service answers anyone who can reach it, browsers included: a web page
may post a document to it (cross-site request), and a page on a domain re-pointed at 127.0.0.1
(DNS rebinding) may even read the answers. Two checks close both: the ``Host`` header must name
one of the allowed hosts (a rebound domain does not), and an ``Origin`` header, which browsers
send with cross-site and script requests, must name the same host as ``Host`` (the service's own
web page does; another site's does not; ``Origin: null`` never does). Refusals are ``403`` in the
service's error format. Which hosts are allowed is ``ServeConfig.host_allow_list()``.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from mineru_fast.serve.security import ASGIApp, Receive, Scope, Send, send_error

__all__ = ["HostCheckMiddleware", "host_name"]


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")


def host_name(value: str) -> str | None:
    """The host part of a ``Host`` header value, lower-case, without port or IPv6 brackets.

    Returns:
        None when the value is not ``host[:port]`` (a name, an IPv4 address or a bracketed IPv6 one).
    """
    match = _HOST.fullmatch(value.strip())
    if match is None:
        return None
    return match.group(1).strip("[]").lower()


def _origin_host(value: str) -> str | None:
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018
    except ValueError:
        return None
    if parts.scheme not in ("http", "https"):
        return None  # includes "null" (sandboxed pages, files)
    return parts.hostname or None


class HostCheckMiddleware:
    """ASGI middleware refusing requests whose ``Host`` is not allowed or whose ``Origin`` is foreign.

    Args:
        app: the wrapped ASGI application.
        allowed_hosts: lower-case host names (no ports); ``"*"`` in it allows any ``Host``.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.lower(): value.decode("latin-1") for key, value in scope.get("headers", [])}
        host = host_name(headers.get(b"host", ""))
        if host is None or not (self.any_host or host in self.allowed):
            await send_error(send, scope, 403, "host_not_allowed", "this server does not answer for that Host")
            return
        origin = headers.get(b"origin")
        if origin is not None and _origin_host(origin) != host:
            await send_error(send, scope, 403, "origin_not_allowed", "cross-origin requests are not accepted")
            return
        await self.app(scope, receive, send)
