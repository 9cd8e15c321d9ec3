"""``ServeConfig``: every setting of the HTTP service in one validated object."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mineru_fast.options import ParserOptions
from mineru_fast.runtime.hub import DEFAULT_MODEL_ID

__all__ = ["ServeConfig", "CanaryMode", "CANARY_MODES"]

CanaryMode = Literal["after-ready", "before-ready", "off"]
CANARY_MODES: tuple[CanaryMode, ...] = ("after-ready", "before-ready", "off")
"""When the canary page is parsed (``ServeConfig.canary``)."""

_HOST_NAME = re.compile(r"\[?[A-Za-z0-9.:_-]{1,253}\]?")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``mineru-fast serve``; invalid values raise ``ValueError`` at construction.

    Attributes:
        model: model directory or hub id, loaded once at start-up.
        options: parser options of the service's one parser.
        host / port: where uvicorn listens (loopback by default).
        workers: documents parsed at once (worker threads); they share the one model, whose engine
            batches their pages together with the chat requests.
        queue_size: jobs that may wait for a worker; beyond it requests get ``429``.
        api_key_file: file of API keys (see ``security.load_api_keys``); None = no keys needed.
        rate_limit: requests per minute per API key (per client address without keys); 0 = off.
        rate_burst: requests a key may make at once before the rate applies.
        max_upload_mb: largest request body in MiB, enforced while it streams in.
        max_body_buffer_mb: MiB of request bodies the requests in flight may hold together, each
            reserving its ``Content-Length`` before its body is read and keeping it until
            answered (a synchronous parse until its result); one API key's requests a quarter of
            it (at least ``max_upload_mb``). A request that would pass it is answered ``503``
            (``429`` past its key's share) with ``Retry-After``, before its body is read; one
            over it alone ``413``. None = the default: ``max_upload_mb`` per job the server may
            hold (``workers`` plus ``queue_size``), as the uploads of MinerU's API.
        result_ttl: seconds a finished job's result is kept, then deleted.
        drain_timeout: seconds a SIGTERM waits for queued and running jobs to finish and their
            results to be fetched (new jobs are refused meanwhile) before the server stops; a
            synchronous parse still waiting then is answered ``503 shutting_down``. The default,
            300, is above one full-size page (about 127 s on 2 cores).
        header_timeout: seconds a connection may take to send a request's line and headers
            (from connecting, or from the previous response); then it is closed.
        body_timeout: longest pause, in seconds, while a request body is read; then ``408``.
        min_body_rate: bytes per second a request body must average once ``body_timeout`` seconds
            have passed since the request began; slower bodies get ``408``.
        max_connections: open connections at most; more are answered ``503`` and closed at once
            (also kept below the process's open-file limit).
        write_timeout: seconds a connection holding more unread response bytes than the
            transport's high-water mark (64 KiB) may go without its client reading
            ``min_body_rate`` bytes per second of them; then it is closed and the bytes freed.
        max_response_buffer_mb: MiB of unread response bytes such connections may hold together;
            beyond it those waiting longest are closed (never the last one).
        decode_budget_mb: MiB of page and image memory that admitted work may hold at once: the
            jobs queued and running (synchronous parses included) and the chat images being
            decoded or answered, each costed from its headers at the measured bytes per pixel of
            its source (``inputs.OpenedDocument.page_cost``); beyond it ``429``, and one that
            alone needs more ``413``.
        allowed_hosts: host names a request's ``Host`` header may carry (``"*"`` = any); None =
            the default: without API keys, the loopback names and ``host`` (any host when
            listening on all interfaces), with API keys no check. When checked, a browser's
            ``Origin`` must name the same host as ``Host``.
        allow_replay: accept a ``replay`` trace upload (tests and benchmarks only).
        replay_dir: directory of ``<stem>.json`` replay traces: a document sent to MinerU's
            document API (``mineru_api``) whose file name's stem names one is replayed (tests and
            benchmarks only; MinerU's clients cannot send a trace); None = none.
        max_pages: most pages one request may select.
        max_chat_requests: chat completions in flight at once (queued or running), an outer
            bound; beyond it ``429``. Requests past the engine's slots wait in a queue bounded by
            ``decode_budget_mb``; the default, 256, lets MinerU's client (100 at once) through.
        chat_keepalive: seconds a chat answer may take before it is sent as a stream: ``200`` at
            once, then a space (JSON) or a ``: keepalive`` comment (SSE) every this many seconds
            until the answer, so a client's read timeout never fires on a queued request.
        chat_orphan_grace: seconds a running chat generation keeps going once every request
            waiting for it has gone (an orphan), so a client's re-send of the same body joins it,
            while no other request waits for a place or a first token; then it is cancelled. A
            queued orphan is dropped at once; orphans count against ``max_chat_requests``.
        chat_replay: a file of recorded chat answers to replay (``chat.ChatReplay``; tests and
            benchmarks); None = decode.
        canary: when the canary page (``parsing.run_canary``: a whole replayed page, layout pass
            included; about a minute with the full-size model on 2 cores) is parsed:
            ``"after-ready"`` (the default) in a thread of its own once the service is ready (jobs
            are taken meanwhile), ``"before-ready"`` before it becomes ready, ``"off"`` never. The
            service is ready once the model is loaded and the engine check
            (``startup.run_engine_check``, seconds) passed; a canary that fails turns it
            ``failed`` (``/ready`` answers ``503``) in any mode.
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
    """

    model: str = DEFAULT_MODEL_ID
    options: ParserOptions = field(default_factory=ParserOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 4
    queue_size: int = 8
    api_key_file: Path | None = None
    rate_limit: float = 0.0
    rate_burst: int = 10
    max_upload_mb: float = 50.0
    max_body_buffer_mb: float | None = None
    result_ttl: float = 600.0
    drain_timeout: float = 300.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    min_body_rate: float = 1024.0
    max_connections: int = 128
    write_timeout: float = 30.0
    max_response_buffer_mb: float = 256.0
    decode_budget_mb: float = 4096.0
    allowed_hosts: tuple[str, ...] | None = None
    allow_replay: bool = False
    replay_dir: Path | None = None
    max_pages: int = 500
    max_chat_requests: int = 256
    chat_keepalive: float = 15.0
    chat_orphan_grace: float = 10.0
    chat_replay: Path | None = None
    canary: CanaryMode = "after-ready"
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("workers", "queue_size", "rate_burst", "max_pages", "max_connections", "max_chat_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        positive: tuple[str, ...] = (
            "max_upload_mb",
            "result_ttl",
            "header_timeout",
            "body_timeout",
            "min_body_rate",
            "decode_budget_mb",
            "write_timeout",
            "max_response_buffer_mb",
            "chat_keepalive",
        )
        if self.max_body_buffer_mb is not None:
            positive += ("max_body_buffer_mb",)
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("rate_limit", "drain_timeout", "chat_orphan_grace"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for host in self.allowed_hosts or ():
            if host != "*" and not _HOST_NAME.fullmatch(host):
                raise ValueError(f"allowed_hosts: {host[:40]!r} is not a host name or address (no port, no scheme)")
        if self.replay_dir is not None and not Path(self.replay_dir).is_dir():
            raise ValueError(f"replay_dir {self.replay_dir} is not a directory")
        if self.canary not in CANARY_MODES:
            raise ValueError(f"canary must be one of {', '.join(CANARY_MODES)}, got {self.canary!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    @property
    def decode_budget_bytes(self) -> int:
        """``decode_budget_mb`` in bytes."""
        return int(self.decode_budget_mb * 1024 * 1024)

    def host_allow_list(self) -> tuple[str, ...] | None:
        """The ``Host`` names accepted, lower-case (``("*",)`` = any), or None when nothing is checked."""
        if self.allowed_hosts is not None:
            return tuple(h.lower().strip("[]") for h in self.allowed_hosts)
        if self.api_key_file is not None:
            return None
        if self.host in ("0.0.0.0", "::", ""):
            return ("*",)
        return tuple(dict.fromkeys(("localhost", "127.0.0.1", "::1", self.host.lower().strip("[]"))))

    @property
    def max_response_buffer_bytes(self) -> int:
        """``max_response_buffer_mb`` in bytes."""
        return int(self.max_response_buffer_mb * 1024 * 1024)

    @property
    def max_upload_bytes(self) -> int:
        """``max_upload_mb`` in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def max_body_buffer_bytes(self) -> int:
        """``max_body_buffer_mb`` in bytes (its default when None)."""
        if self.max_body_buffer_mb is None:
            return self.max_upload_bytes * (self.workers + self.queue_size)
        return int(self.max_body_buffer_mb * 1024 * 1024)

    @property
    def key_body_buffer_bytes(self) -> int:
        """The bytes of request bodies one API key's requests in flight may hold together: a
        quarter of ``max_body_buffer_bytes``, at least one full-size upload (at most all of it)."""
        whole = self.max_body_buffer_bytes
        return min(whole, max(self.max_upload_bytes, whole // 4))
