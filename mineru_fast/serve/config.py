"""``ServeConfig``: every setting of the HTTP service in one validated object."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..hub import DEFAULT_MODEL_ID
from ..options import ParserOptions

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``mineru-fast serve``; invalid values raise ``ValueError`` at construction.

    Attributes:
        model: model directory or hub id, loaded once at start-up.
        options: parser options (one parser per worker is built with them).
        host / port: where uvicorn listens (loopback by default).
        workers: worker threads, each with its own parser (parsers are not thread-safe).
        queue_size: jobs that may wait for a worker; beyond it requests get ``429``.
        api_key_file: file of API keys (see ``security.load_api_keys``); None = no keys needed.
        rate_limit: requests per minute per API key (per client address without keys); 0 = off.
        rate_burst: requests a key may make at once before the rate applies.
        max_upload_mb: largest request body in MiB, enforced while it streams in.
        result_ttl: seconds a finished job's result is kept, then deleted.
        drain_timeout: seconds graceful shutdown waits for queued and running jobs.
        allow_replay: accept a ``replay`` trace upload (tests and benchmarks only).
        max_pages: most pages one request may select.
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
    """

    model: str = DEFAULT_MODEL_ID
    options: ParserOptions = field(default_factory=ParserOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    queue_size: int = 8
    api_key_file: Path | None = None
    rate_limit: float = 0.0
    rate_burst: int = 10
    max_upload_mb: float = 50.0
    result_ttl: float = 600.0
    drain_timeout: float = 60.0
    allow_replay: bool = False
    max_pages: int = 500
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("workers", "queue_size", "rate_burst", "max_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_upload_mb", "result_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("rate_limit", "drain_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    @property
    def max_upload_bytes(self) -> int:
        """``max_upload_mb`` in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)
