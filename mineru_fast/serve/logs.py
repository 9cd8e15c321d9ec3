"""JSON-lines logs for the service.

Each record is one JSON object on one line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
``message`` and the whitelisted context fields passed with ``extra=`` (request id, job id, status,
durations, sizes). Nothing else from a record is written, so document contents, file names,
passwords and API keys stay out of the logs as long as messages do not carry them (the service's
own messages never do).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

__all__ = ["JsonLinesFormatter", "CONTEXT_FIELDS", "configure_logging", "uvicorn_log_config"]

CONTEXT_FIELDS = (
    "request_id",
    "job_id",
    "key",
    "method",
    "route",
    "status",
    "duration_ms",
    "bytes_in",
    "bytes_decoded",
    "pages",
    "page_count",
    "format",
    "queue_length",
    "in_flight",
    "worker",
    "code",
    "seconds",
    "host",
    "port",
    "cancelled",
    "suppressed",
    "limit",
    "tokens",
)


class JsonLinesFormatter(logging.Formatter):
    """Formats a ``LogRecord`` as one JSON object (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str = "info") -> None:
    """Make the process log JSON lines to stderr: ``mineru_fast`` loggers at ``level``, other
    libraries' loggers and Python warnings at ``warning`` and above.

    Raises:
        ValueError: unknown level name.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLinesFormatter())
    for name, logger_level in (("", logging.WARNING), ("mineru_fast", numeric)):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logger_level)
    logging.getLogger("mineru_fast").propagate = False
    logging.captureWarnings(True)


def uvicorn_log_config(level: str = "info") -> dict:
    """A ``logging.config`` dict making uvicorn's own loggers write JSON lines too.

    uvicorn's access log is left off: the service writes one JSON line per request itself, with
    its request id.
    """
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonLinesFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": upper, "propagate": False},
            "uvicorn.error": {"handlers": ["stderr"], "level": upper, "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
