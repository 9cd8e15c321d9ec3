"""The ``mineru-fast serve`` subcommand: its arguments and how they become a ``ServeConfig``.

Importing this module needs none of the ``serve`` extra's packages, so ``mineru-fast --help``
works without them; running the command checks for them first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from mineru_fast.cli.options import add_options_arguments, options_from_args
from mineru_fast.errors import MineruFastError
from mineru_fast.serve.config import CANARY_MODES, ServeConfig

__all__ = ["add_serve_command", "config_from_args", "run_serve_command"]

_WORK_THREADS = ("model-loader", "parse-worker", "canary")  # thread names given in app.py, jobs.py, service.py


class _Replaced(argparse.Action):
    """``--pixel-budget`` (megapixels, before 2026-12): an error naming its replacement, not
    argparse's "unrecognized arguments"."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        parser.error("--pixel-budget was replaced by --decode-budget-mb: the budget is now the bytes that "
                     "decoding the pages and images in flight takes (README, HTTP service)")  # fmt: skip


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subparser (the options flags are ``parse``'s, see ``cli.options``)."""
    v = sub.add_parser("serve", help="HTTP service (needs the serve extra: pip install 'mineru-fast[serve]')")
    v.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    v.add_argument("--port", type=int, default=8000, help="listen port (default: %(default)s)")
    v.add_argument("--workers", type=int, default=4, help="documents parsed at once, sharing one model (default: 4)")
    v.add_argument(
        "--workers-queue", type=int, default=8, metavar="N", help="jobs that may wait; beyond it 429 (default: 8)"
    )
    v.add_argument("--api-key-file", type=Path, help="lines NAME:SECRET[:RATE_PER_MIN]; /v1/* then needs a key")
    v.add_argument("--rate-limit", type=float, default=0.0, help="requests per minute per key (default: 0 = off)")
    v.add_argument("--rate-burst", type=int, default=10, help="requests a key may send at once (default: 10)")
    v.add_argument("--max-upload-mb", type=float, default=50.0, help="largest request body in MiB (default: 50)")
    v.add_argument(
        "--max-body-buffer-mb",
        type=float,
        metavar="MIB",
        help="request bodies the requests in flight may hold at once, a quarter per API key; beyond it 503 "
        "(default: --max-upload-mb x (--workers + --workers-queue))",
    )
    v.add_argument("--result-ttl", type=float, default=600.0, help="seconds job results are kept (default: 600)")
    v.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="seconds a SIGTERM waits for jobs to finish and be fetched (default: 300, above one "
        "full-size page on 2 cores)",
    )
    v.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds a request's headers may take (default: 10)"
    )
    v.add_argument(
        "--body-timeout", type=float, default=30.0, help="longest pause while a body is read, seconds (default: 30)"
    )
    v.add_argument(
        "--min-body-rate",
        type=float,
        default=1024.0,
        metavar="BYTES_PER_S",
        help="average a body must keep after --body-timeout seconds (default: 1024)",
    )
    v.add_argument("--max-connections", type=int, default=128, help="open connections at most (default: 128)")
    v.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a client may leave a response unread (under --min-body-rate) before it is cut off (default: 30)",
    )
    v.add_argument(
        "--max-response-buffer-mb",
        type=float,
        default=256.0,
        metavar="MIB",
        help="unread response bytes held for slow clients at most (default: 256)",
    )
    v.add_argument(
        "--decode-budget-mb",
        type=float,
        default=4096.0,
        metavar="MIB",
        help="page and image memory of queued and running jobs and chat images at most; beyond it 429 (default: 4096)",
    )
    v.add_argument("--pixel-budget", action=_Replaced, help=argparse.SUPPRESS)
    v.add_argument(
        "--allowed-hosts",
        metavar="H1,H2",
        help="Host header names accepted ('*' = any); default without keys: loopback names and --host",
    )
    v.add_argument("--max-pages", type=int, default=500, help="most pages per request (default: 500)")
    v.add_argument(
        "--render-timeout",
        type=float,
        default=60.0,
        help="seconds a PDF page may take to render, in its own process; then that page fails (default: 60)",
    )
    v.add_argument(
        "--max-chat-requests",
        type=int,
        default=256,
        help="chat completions in flight at once, queued or running; beyond it 429 (default: 256)",
    )
    v.add_argument(
        "--chat-keepalive",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="a chat answer not ready by then is streamed: 200 at once, a keep-alive byte this often (default: 15)",
    )
    v.add_argument(
        "--chat-orphan-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a running chat generation whose clients all left runs this long for a re-send to join it, "
        "while no other request waits (default: 10)",
    )
    v.add_argument(
        "--chat-replay", type=Path, metavar="FILE", help="recorded chat answers to replay (tests, benchmarks)"
    )
    v.add_argument(
        "--canary",
        choices=CANARY_MODES,
        default="after-ready",
        help="when the canary page (a whole replayed page, layout pass included: about a minute at full size on "
        "2 cores) is parsed: in the background once ready, before ready, or never; ready waits for a small "
        "engine check only, and a failed canary turns /ready to 503 (default: %(default)s)",
    )
    v.add_argument("--allow-replay", action="store_true", help="accept replay trace uploads (tests, benchmarks)")
    v.add_argument(
        "--replay",
        type=Path,
        metavar="DIR",
        help="directory of <stem>.json traces replayed for MinerU-API uploads of that file stem (tests, benchmarks)",
    )
    v.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="least level of the JSON log lines on stderr (default: %(default)s)",
    )
    r = v.add_argument_group("Ray Serve (needs the ray extra: pip install 'mineru-fast[ray]')")
    r.add_argument("--ray", action="store_true", help="run the service as a Ray Serve application (replicas)")
    r.add_argument("--ray-address", help="Ray cluster address (default: start a local Ray)")
    r.add_argument("--replicas", type=int, default=1, help="replicas, each with its own model (default: 1)")
    r.add_argument("--cores-per-replica", type=int, default=1, help="CPUs and parser threads per replica (default: 1)")
    r.add_argument(
        "--autoscale",
        metavar="MIN,MAX",
        help="scale between MIN and MAX replicas on ongoing requests (target: --workers per replica)",
    )
    add_options_arguments(v)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` the parsed arguments describe.

    Raises:
        MineruFastError: an invalid value, or an unreadable or malformed API key file (checked
            here, before the model is loaded).
    """
    from mineru_fast.serve.security import load_api_keys

    options = options_from_args(args, progress=False, render_timeout=args.render_timeout)
    try:
        config = ServeConfig(
            model=args.model,
            options=options,
            host=args.host,
            port=args.port,
            workers=args.workers,
            queue_size=args.workers_queue,
            api_key_file=args.api_key_file,
            rate_limit=args.rate_limit,
            rate_burst=args.rate_burst,
            max_upload_mb=args.max_upload_mb,
            max_body_buffer_mb=args.max_body_buffer_mb,
            result_ttl=args.result_ttl,
            drain_timeout=args.drain_timeout,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            min_body_rate=args.min_body_rate,
            max_connections=args.max_connections,
            write_timeout=args.write_timeout,
            max_response_buffer_mb=args.max_response_buffer_mb,
            decode_budget_mb=args.decode_budget_mb,
            allowed_hosts=tuple(filter(None, args.allowed_hosts.split(","))) if args.allowed_hosts else None,
            allow_replay=args.allow_replay,
            replay_dir=args.replay,
            max_pages=args.max_pages,
            max_chat_requests=args.max_chat_requests,
            chat_keepalive=args.chat_keepalive,
            chat_orphan_grace=args.chat_orphan_grace,
            chat_replay=args.chat_replay,
            canary=args.canary,
            log_level=args.log_level,
        )
        if config.api_key_file is not None:
            load_api_keys(config.api_key_file)
        if config.chat_replay is not None:
            from mineru_fast.serve.chat import ChatReplay

            ChatReplay(config.chat_replay)  # refused here, before the model is loaded
    except OSError as exc:
        raise MineruFastError(f"--chat-replay: {exc}") from exc
    except ValueError as exc:
        raise MineruFastError(str(exc)) from exc
    return config


def run_serve_command(args: argparse.Namespace) -> int:
    """Run ``mineru-fast serve``; returns the exit status (see ``server.serve``).

    When the server has stopped while a thread still loads the model or parses a page (a signal
    during start-up, a drain that timed out), the process ends here with ``os._exit``: such a
    thread cannot be stopped, and the interpreter aborts (status 134) if it finalizes under it.

    Raises:
        MineruFastError: the ``serve`` extra is missing (``ServeDependencyError``), or a bad
            setting or key file.
    """
    from mineru_fast.serve import require_serve_dependencies

    require_serve_dependencies()
    config = config_from_args(args)
    if args.ray:
        return _run_on_ray(args, config)
    from mineru_fast.serve.server import serve

    status = serve(config)
    busy = [t.name for t in threading.enumerate() if t.name.startswith(_WORK_THREADS) and t.is_alive()]
    if busy:
        logging.getLogger(__name__).info("exiting while threads still work", extra={"status": status})
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _run_on_ray(args: argparse.Namespace, config: ServeConfig) -> int:
    """``serve --ray``: the same application on Ray Serve (``distributed.serve_app``)."""
    from mineru_fast.distributed import require_ray

    require_ray()
    autoscaling = None
    if args.autoscale:
        low, _, high = args.autoscale.partition(",")
        if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise MineruFastError(f"--autoscale expects MIN,MAX with 1 <= MIN <= MAX, got {args.autoscale!r}")
        autoscaling = (int(low), int(high))
    if args.replicas < 1 or args.cores_per_replica < 1:
        raise MineruFastError("--replicas and --cores-per-replica must be >= 1")
    from mineru_fast.distributed.serve_app import run

    return run(config, args.ray_address, args.replicas, args.cores_per_replica, autoscaling)
