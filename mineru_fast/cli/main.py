"""``mineru-fast`` command line: parse, prepare, synth-model, bench, trace, serve, launch, batch, info.

Exit status of ``parse``: 0 every page parsed, 1 some pages failed or are partial, or some inputs
could not be read while others were parsed (the rest is saved; each problem is on stderr), 2 a usage
error or no input could be read (one line on stderr, no traceback), 4 an output error: a folder or
file that cannot be written (one ``mineru-fast: error:`` line; parsing stops, nothing half-written
is left of the document).
``launch`` merges its workers' statuses (3: a worker crashed). ``prepare`` (``cli.prepare``): 0 the
prepared model is in the cache (or the options need none), 2 the model cannot be loaded or the cache
is turned off, 4 the cache cannot be written. Commands that run the model set OpenMP variables
(``threads.configure_process``) before torch loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mineru_fast._version import __version__
from mineru_fast.cli.options import (
    add_batch_arguments,
    add_model_arguments,
    add_parse_arguments,
    hub_kwargs,
    options_from_args,
    positive_int,
)
from mineru_fast.cli.prepare import add_prepare_command, run_prepare_command
from mineru_fast.cli.serve import add_serve_command, run_serve_command
from mineru_fast.errors import MineruFastError, OutputError
from mineru_fast.inputs.paths import clash_message, expand_inputs, output_clashes
from mineru_fast.protocol.spec import DEFAULT_MODEL_VERSION, MODEL_VERSIONS
from mineru_fast.results.formats import OFFICIAL_TARGETS
from mineru_fast.results.official import available as official_available

if TYPE_CHECKING:
    from mineru_fast.results.metadata import InputInfo

EXIT_OK, EXIT_PAGES_FAILED, EXIT_USAGE, EXIT_OUTPUT = 0, 1, 2, 4  # 3 is launch's EXIT_CRASHED
OUTPUT_CLASH = "output_clash"  # code of the error event of an input whose output folder another input writes too


def _instances(text: str) -> str | int:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a count >= 1, got {text!r}")
    return int(text)


def build_argparser() -> argparse.ArgumentParser:
    """The ``mineru-fast`` argument parser with every subcommand."""
    ap = argparse.ArgumentParser(prog="mineru-fast", description="Fast CPU document parsing with MinerU2.5.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log warnings (e.g. dropped layout lines)")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    add_parse_arguments(sub.add_parser("parse", help="parse PDFs and images into Markdown and JSON"))
    add_prepare_command(sub)

    s = sub.add_parser("synth-model", help="write a random-weight model of the MinerU2.5 architecture")
    s.add_argument("directory", type=Path, help="model directory to write (created; model files in it are overwritten)")
    s.add_argument(
        "--size",
        choices=("tiny", "full"),
        default="tiny",
        help="tiny: tests; full: MinerU2.5 shapes (default: %(default)s)",
    )
    s.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: %(default)s)")
    s.add_argument(
        "--lm-gguf",
        type=Path,
        metavar="FILE",
        help="a trained Qwen2 language model of the size's shape (GGUF; needs the gguf package) "
        "replaces the random one; the vision tower stays random",
    )
    s.add_argument(
        "--model-version",
        choices=MODEL_VERSIONS,
        default=DEFAULT_MODEL_VERSION,
        help="the MinerU2.5 version whose protocol the model reports (default: %(default)s)",
    )

    b = sub.add_parser("bench", help="latency tables on this CPU (stage table, concurrency, roofline)")
    b.add_argument("--quick", action="store_true", help="1 page and the key rows: under 15 minutes on 2 cores")
    add_model_arguments(b, None, "model directory or hub id (default: the full synthetic model, made once)")
    b.add_argument("--pages", type=positive_int, help="workload pages (default 4, --quick 1), median page first")
    b.add_argument("--workload", type=Path, help="real OmniDocBench-format pages (annotations.json + images/)")
    b.add_argument("--threads", type=positive_int, help="intra-op threads (default: physical cores available)")
    b.add_argument("-o", "--output", type=Path, default=Path("bench-results"), help="where bench.json/png go")
    b.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only the stage rows whose label contains TEXT (repeatable); skips the concurrency table and roofline",
    )
    b.add_argument(
        "--fidelity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="top-1 agreement and logits cosine of each row vs the float32 engine (default: on, off with --quick)",
    )

    t = sub.add_parser("trace", help="build replay traces from OmniDocBench-format ground truth")
    t.add_argument(
        "--omnidocbench",
        type=Path,
        required=True,
        metavar="ANNOTATIONS.json",
        help="OmniDocBench-format annotations: a JSON list of {page_info, layout_dets}, one per page image",
    )
    t.add_argument(
        "--images", type=Path, required=True, metavar="DIR", help="folder of the page images (page_info.image_path)"
    )
    t.add_argument(
        "-o", "--output", type=Path, required=True, help="folder for the traces, one <image stem>.json per page"
    )

    add_serve_command(sub)

    la = sub.add_parser("launch", help="run parse in pinned workers, one per NUMA node or core group")
    la.add_argument(
        "--instances", type=_instances, default="auto", help="'auto' (one per NUMA node) or a count (default: auto)"
    )
    la.add_argument("--cores-per-instance", type=positive_int, help="physical cores per worker")
    la.add_argument(
        "parse_command",
        nargs=argparse.REMAINDER,
        metavar="-- parse INPUT... -o OUT [options]",
        help="the parse command each worker runs on its share of the inputs",
    )

    add_batch_arguments(sub.add_parser("batch", help="parse a collection on a Ray cluster (needs the ray extra)"))

    i = sub.add_parser("info", help="CPU topology, ISA, threads, backends and what auto would choose")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def _trace_for(replay: Path | None, source: Path, n_inputs: int) -> Path | None:
    if replay is None:
        return None
    if replay.is_dir():
        path = replay / f"{source.stem}.json"
        if not path.is_file():
            raise MineruFastError(f"no trace {path.name} in {replay}")
        return path
    if n_inputs > 1:
        raise MineruFastError("--replay FILE takes one input; pass a directory of <stem>.json for several")
    return replay


def _cmd_parse(args: argparse.Namespace) -> int:
    from mineru_fast.inputs.documents import open_document
    from mineru_fast.pipeline.parser import DocumentParser
    from mineru_fast.results.metadata import InputInfo

    mode = "none" if args.quiet else args.progress
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "lines"
    options = options_from_args(args, progress=mode == "bar", max_pages=args.max_pages)
    status = EXIT_OK
    readable = []
    sources = expand_inputs(args.inputs)
    if not sources:
        print("mineru-fast: no input files found", file=sys.stderr)
        return EXIT_USAGE
    if args.output.exists() and not args.output.is_dir():
        print(f"mineru-fast: -o {args.output} exists and is not a directory", file=sys.stderr)
        return EXIT_USAGE
    if args.format in OFFICIAL_TARGETS and not official_available():
        print(f"mineru-fast: -f {args.format} needs DocVortex, MinerU 4's renderer: pip install "
              "'mineru-fast[mineru4]'", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if clashes := output_clashes(sources):  # one output folder per stem: a clash would overwrite silently
        for first, second in clashes:
            _report_error(mode, second, OUTPUT_CLASH, clash_message(first, second))
        return EXIT_USAGE
    failed = 0  # inputs that could not be read or parsed
    for source in sources:  # refuse unreadable inputs before paying for the model load
        try:
            with open_document(source, pages=args.pages, password=args.password, max_pages=args.max_pages) as opened:
                readable.append((source, _trace_for(args.replay, source, len(sources)), InputInfo.from_opened(opened)))
                for warning in opened.warnings:  # e.g. a page range clamped to the document
                    _report_warning(mode, source, warning)
        except MineruFastError as exc:
            _report_error(mode, source, exc.code, str(exc))
            failed += 1
    if not readable:
        return EXIT_USAGE
    parser = DocumentParser.from_pretrained(args.model, options, **hub_kwargs(args))
    for source, trace, info in readable:
        try:
            status = max(status, _parse_one(parser, source, trace, info, args, mode))
        except OutputError:
            raise  # main's one error line and EXIT_OUTPUT: the next input would fail the same way
        except MineruFastError as exc:
            _report_error(mode, source, exc.code, str(exc))
            failed += 1
    if failed == len(sources):
        return EXIT_USAGE
    return max(status, EXIT_PAGES_FAILED) if failed else status


def _report_warning(mode: str, source: Path, message: str) -> None:
    """Report a warning about one input on stderr: a ``warning`` event with ``--progress json``,
    else the line ``mineru-fast: INPUT: warning: MESSAGE``."""
    if mode == "json":
        print(json.dumps({"event": "warning", "input": str(source), "message": message}), file=sys.stderr, flush=True)
    else:
        print(f"mineru-fast: {source}: warning: {message}", file=sys.stderr)


def _report_error(mode: str, source: Path, code: str, message: str) -> None:
    """Report a problem with one input on stderr: an ``error`` event with ``--progress json``,
    else the line ``mineru-fast: INPUT: MESSAGE`` (a clash's message names both inputs)."""
    if mode == "json":
        event = {"event": "error", "input": str(source), "code": code, "message": message}
        print(json.dumps(event), file=sys.stderr, flush=True)
    elif code == OUTPUT_CLASH:
        print(f"mineru-fast: {message}", file=sys.stderr)
    else:
        print(f"mineru-fast: {_shown(source)}: {message}", file=sys.stderr)


def _shown(path: str | Path) -> str:
    """A path as one line shows it: control characters (a newline in a file name) escaped as
    Python writes them, so one report stays one line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(path))


def _parse_one(parser, source: Path, trace: Path | None, info: InputInfo, args: argparse.Namespace, mode: str) -> int:
    """Parse one input page by page into ``OUTPUT/<stem>/`` (or the file ``--format`` names);
    report progress and problems."""
    import time

    from mineru_fast.results.formats import finish, writer_folder
    from mineru_fast.results.writer import DocumentWriter

    start = time.perf_counter()
    n_pages = len(info.pages)
    folder = writer_folder(args.output, source.stem, args.format)
    layout = "2.x" if args.format == "2.x" else "mineru4"
    with DocumentWriter(
        folder, source.stem, layout=layout, metadata=parser.result_metadata(info), confidence=args.confidence
    ) as writer:  # an exception out of the loop is recorded in the result (status failure)
        pages = parser.iter_pages(source, pages=args.pages, password=args.password, replay=trace, keep_page_images=True)
        _write_pages(writer, pages, source, n_pages, start, mode)
        writer.close(wall_s=time.perf_counter() - start)
    try:
        out = finish(folder, args.output, source.stem, args.format)
    except OSError as exc:
        raise OutputError(f"cannot write the {args.format} output of {source.stem} in {args.output}: {exc}") from exc
    document_status = writer.document_status
    print(f"{_shown(source)}: {document_status}, {len(writer.statuses)} page(s) -> {_shown(out)}")
    return EXIT_OK if document_status == "success" else EXIT_PAGES_FAILED


def _write_pages(writer, pages, source: Path, n_pages: int, start: float, mode: str) -> None:
    """Write each page as it comes and report it (``--progress``) on stderr."""
    import time

    for done, page in enumerate(pages, start=1):
        writer.add_page(page)
        elapsed = time.perf_counter() - start
        if mode == "json":  # the page's problems are in its event
            event = {"event": "page", "input": str(source), "page_index": page.index, "status": page.status,
                     "done": done, "total": n_pages, "elapsed_s": round(elapsed, 3),
                     "errors": [error.to_dict() for error in page.errors], "warnings": page.warnings}  # fmt: skip
            print(json.dumps(event), file=sys.stderr, flush=True)
            continue
        for error in page.errors:
            print(f"mineru-fast: {_shown(source)}: page {page.index + 1}: {error.message}", file=sys.stderr)
        if page.status == "partial":
            for warning in page.warnings:
                print(f"mineru-fast: {_shown(source)}: page {page.index + 1}: {warning}", file=sys.stderr)
        if mode == "lines":
            eta = elapsed / done * (n_pages - done)
            print(
                f"mineru-fast: {_shown(source.name)}: page {page.index + 1} {page.status} ({done}/{n_pages}, "
                f"{60 * done / elapsed:.2f} pages/min, ETA {eta:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


def _cmd_synth_model(args: argparse.Namespace) -> int:
    from mineru_fast.engine.synthetic import make_synthetic_model

    out = make_synthetic_model(
        args.directory, size=args.size, seed=args.seed, version=args.model_version, lm_gguf=args.lm_gguf
    )
    lm = f" with the language model of {args.lm_gguf.name}" if args.lm_gguf else ""
    print(f"wrote {args.size} synthetic model{lm} ({args.model_version} protocol) to {out}")
    return EXIT_OK


def _resolve_model_flag(args: argparse.Namespace) -> None:
    """Replace ``args.model`` by its local directory, downloading it once if allowed, for commands
    that hand ``--model`` on as a path (``bench``'s row processes, ``serve``'s workers).

    Raises:
        MineruFastError: hub flags without ``--model``; ``ModelLoadError`` / ``ModelNotCached``.
    """
    from mineru_fast.runtime.hub import resolve_model

    hub = hub_kwargs(args)
    if args.model is None:
        if any(value is not None for value in hub.values()):
            raise MineruFastError("--revision, --cache-dir, --token and --offline apply to a hub id given with --model")
        return
    args.model = str(resolve_model(args.model, **hub))


def _cmd_bench(args: argparse.Namespace) -> int:
    from mineru_fast.bench.run import main as bench_main

    _resolve_model_flag(args)
    return bench_main(args.model, args.quick, args.pages, args.workload, args.threads, args.output, only=args.only,
                      fidelity=args.fidelity)  # fmt: skip


def _cmd_trace(args: argparse.Namespace) -> int:
    from mineru_fast.protocol.traces import build_omnidocbench_traces

    paths = build_omnidocbench_traces(args.omnidocbench, args.images, args.output)
    print(f"wrote {len(paths)} trace(s) to {args.output}")
    return EXIT_OK


def _cmd_launch(args: argparse.Namespace) -> int:
    from mineru_fast.cli.launch import launch

    command = args.parse_command[1:] if args.parse_command[:1] == ["--"] else args.parse_command
    return launch(command, args.instances, args.cores_per_instance)


def _cmd_batch(args: argparse.Namespace) -> int:
    from mineru_fast.distributed.batch import BatchConfig, run_batch

    options = options_from_args(args, progress=False, max_pages=args.max_pages)
    config = BatchConfig(
        inputs=args.inputs,
        output=args.output,
        model=args.model,
        options=options,
        address=args.ray_address,
        actors=args.actors,
        cores_per_actor=args.cores_per_actor,
        max_retries=args.max_retries,
        resume=args.resume,
        replay=args.replay,
        pages=args.pages,
        password=args.password,
        pages_per_task=args.pages_per_task,
        confidence=args.confidence,
        layout="2.x" if args.format == "2.x" else "mineru4",
        quiet=args.quiet,
    )
    summary = run_batch(config)
    counts: dict[str, int] = {}
    for record in summary.records:
        counts[record.status] = counts.get(record.status, 0) + 1
    done = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing to do"
    rate = 60 * summary.pages / summary.wall_s if summary.wall_s else 0.0
    print(f"{done}; {len(summary.skipped)} skipped (complete); {summary.pages} pages in {summary.wall_s:.1f} s "
          f"({rate:.2f} pages/min) -> {args.output / 'manifest.jsonl'}")  # fmt: skip
    return summary.exit_status


def _cmd_serve(args: argparse.Namespace) -> int:
    _resolve_model_flag(args)  # every worker then loads the same snapshot, without a hub look-up each
    return run_serve_command(args)


def _cmd_info(args: argparse.Namespace) -> int:
    from mineru_fast.cli.info import collect, render

    info = collect()
    print(json.dumps(info, indent=1) if args.json else render(info))
    return EXIT_OK


# Commands that run the model in this process bind OpenMP threads; bench starts row processes after
# running torch, so it only sizes the pool (binding would pin its main thread and thus its children).
_THREAD_BINDING = {"parse": True, "prepare": True, "serve": True, "bench": False}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mineru-fast`` console script; returns the exit status."""
    args = build_argparser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.captureWarnings(True)  # libraries' warnings go through logging (shown with -v), not as bare lines
    if getattr(args, "no_prepared_cache", False):  # in the environment: workers and child processes follow
        from mineru_fast.runtime.hub import PREPARED_CACHE_ENV

        os.environ[PREPARED_CACHE_ENV] = "off"
    if args.command in _THREAD_BINDING:
        from mineru_fast.runtime.threads import configure_process

        configure_process(getattr(args, "threads", None), bind=_THREAD_BINDING[args.command])
    commands = {
        "launch": _cmd_launch,
        "info": _cmd_info,
        "parse": _cmd_parse,
        "prepare": run_prepare_command,
        "synth-model": _cmd_synth_model,
        "trace": _cmd_trace,
        "bench": _cmd_bench,
        "serve": _cmd_serve,
        "batch": _cmd_batch,
    }
    try:
        return commands[args.command](args)
    except OutputError as exc:
        print(f"mineru-fast: error: {exc}", file=sys.stderr)
        return EXIT_OUTPUT
    except MineruFastError as exc:
        print(f"mineru-fast: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mineru-fast: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
