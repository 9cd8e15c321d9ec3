"""The ``mineru-fast prepare`` subcommand: write the prepared-model cache ahead of time.

Preparing a checkpoint (reading its weights, quantizing them to INT8, packing them) is most of a
cold start; the fast engine keeps the result in the prepared-model cache (``engine.prepared``,
under ``hub.prepared_cache_root()``: ``$MINERU_FAST_PREPARED_CACHE`` or the package cache's
``prepared`` folder) and reads it at the next start. ``prepare`` builds the engine once, as
``parse`` and ``serve`` would with the same flags (it takes theirs, so the entry's key is the one
they look up), which writes the entry, and says where it is: for container images and machines
that start many workers.
"""

from __future__ import annotations

import argparse
import time

from mineru_fast.cli.options import add_options_arguments, hub_kwargs, options_from_args
from mineru_fast.errors import MineruFastError, OutputError

__all__ = ["add_prepare_command", "run_prepare_command"]


def add_prepare_command(sub: argparse._SubParsersAction) -> None:
    """Add the ``prepare`` subparser (the model and options flags are ``parse``'s, see ``cli.options``)."""
    p = sub.add_parser(
        "prepare",
        help="write the prepared (quantized) model cache ahead of time, for parse and serve with the same flags",
        description="Build the engine once, as parse and serve do with the same model and options flags, "
        "which writes the prepared-model cache ($MINERU_FAST_PREPARED_CACHE, default: the package cache's "
        "prepared folder); prints where the prepared model is and whether it was written now.",
    )
    add_options_arguments(p)


def run_prepare_command(args: argparse.Namespace) -> int:
    """Run ``mineru-fast prepare``: build the engine, which writes the prepared-model entry, and
    print one line: where the entry is and whether it was written now or already present (or that
    the options need none: only INT8 models of the fast engine are cached).

    Returns:
        0.

    Raises:
        MineruFastError: the cache is turned off (``--no-prepared-cache``,
            ``MINERU_FAST_PREPARED_CACHE=off``), an invalid option, or the model cannot be found or
            loaded (``ModelLoadError``).
        OutputError: the entry could not be written (e.g. the folder is read-only or the disk full).
    """
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.runtime.hub import PREPARED_CACHE_ENV, prepared_cache_root, resolve_model_info

    root = prepared_cache_root()
    if args.no_prepared_cache or root is None:
        raise MineruFastError(
            f"prepare writes the prepared-model cache, which --no-prepared-cache or {PREPARED_CACHE_ENV}=off "
            f"turns off: drop the flag, or set {PREPARED_CACHE_ENV} to a folder"
        )
    options = options_from_args(args, progress=False)
    info = resolve_model_info(args.model, **hub_kwargs(args))
    start = time.perf_counter()
    engine = build_engine(info.local_dir, options)
    seconds = time.perf_counter() - start
    try:  # the fast engine says what it read or wrote (engine.generate.FastEngine); others cache nothing
        entry = getattr(engine, "prepared_entry", None)
        problem = getattr(engine, "prepared_problem", None)
        committed = bool(getattr(engine, "cache_committed", False))
        read = getattr(engine, "prepared_from", None) == "cache"
    finally:
        engine.close()
    name = info.model_id or info.local_dir.name
    if committed:
        print(f"prepared model of {name}: written now to {entry} ({seconds:.1f} s)")
    elif read:
        print(f"prepared model of {name}: already present in {entry}")
    elif entry is not None:
        print(f"prepared model of {name}: already present in {entry} (written meanwhile by another process)")
    elif problem is not None:
        raise OutputError(f"the prepared model of {name} could not be written under {root}: {problem}")
    else:
        print(
            f"prepared model of {name}: nothing to prepare, these options run the model as the checkpoint "
            "stores it (only the fast engine's INT8 models are cached)"
        )
    return 0
