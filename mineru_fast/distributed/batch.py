"""``mineru-fast batch``: parse a collection of documents on a Ray cluster (or a local Ray).

Each of ``actors`` Ray actors (``worker.DocumentWorker``, ``num_cpus=cores_per_actor``) holds one
parser with that many threads. The driver gives every actor a thread that takes documents from one
shared queue, so each actor parses one document at a time and work is balanced as documents finish.
Document bytes travel to the actor and its output files travel back page by page (a streaming
actor method, with backpressure), so the machines need no shared file system; only the driver
reads inputs and writes ``OUTPUT``.

Outputs are atomic: a document's files go to ``OUTPUT/.partial/<name>.<attempt>/`` and the folder
is renamed to ``OUTPUT/<name>/`` once complete; then its record is appended to
``OUTPUT/manifest.jsonl`` (``manifest``). An actor that dies (killed, out of memory, node lost) is
restarted by Ray (``max_restarts=-1``); the document it held is parsed again, up to ``max_retries``
more times, then recorded as ``error`` with the last error. An input that cannot be read
(``InputError``) is recorded as ``error`` at once: retrying would not change it. ``resume`` skips
documents whose outputs are complete. Progress: a line per document with pages/min and an ETA.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cli_options import output_clashes
from ..errors import MineruFastError
from ..options import ParserOptions
from ..traces import Trace, load_trace
from . import require_ray
from .manifest import Manifest, Record
from .sources import Source, list_sources
from .worker import DocumentWorker

__all__ = ["BatchConfig", "BatchError", "BatchSummary", "run_batch"]

PARTIAL = ".partial"
RESTART_TIMEOUT_S = 600.0  # longest wait for a restarted actor (it loads the model again)
BACKPRESSURE = 2  # page events an actor may run ahead of the driver (bounds the object store's share)


class BatchError(MineruFastError):
    """A batch that cannot start: no inputs, clashing output names, actors that fail to load."""


@dataclass(frozen=True)
class BatchConfig:
    """What ``run_batch`` parses and how.

    Attributes:
        inputs: local files, directories and globs, and pyarrow filesystem URIs (``sources``).
        output: writes ``OUTPUT/<stem>/`` per input and ``OUTPUT/manifest.jsonl``.
        model: model directory (the same path on every node) or hub id.
        options: parser options (their ``threads`` become ``cores_per_actor``).
        address: Ray cluster address (``ray start --head`` prints it; ``"auto"`` finds a local
            one); None starts a Ray on this machine with its usable cores.
        actors: parser actors; None: as many as the cluster's CPUs allow at ``cores_per_actor``.
        cores_per_actor: CPUs (threads) per actor; None: the CPUs of the smallest node.
        max_retries: further attempts of a document whose actor died or raised.
        resume: skip documents complete in the manifest and on disk.
        replay: trace directory of ``<stem>.json`` (tests, benchmarks) or None.
        pages / password: as ``DocumentParser.iter_pages``, for every input.
    """

    inputs: list[str | Path]
    output: Path
    model: str
    options: ParserOptions = field(default_factory=ParserOptions)
    address: str | None = None
    actors: int | None = None
    cores_per_actor: int | None = None
    max_retries: int = 2
    resume: bool = False
    replay: Path | None = None
    pages: str | None = None
    password: str | None = None


@dataclass
class BatchSummary:
    """The outcome of a run: one record per document parsed now, the documents skipped, the time."""

    records: list[Record]
    skipped: list[str]
    wall_s: float
    actors: int

    @property
    def pages(self) -> int:
        """Pages parsed in this run."""
        return sum(r.pages for r in self.records)

    @property
    def exit_status(self) -> int:
        """0 every document ``success``, 1 otherwise (as ``mineru-fast parse``)."""
        return 0 if all(r.status == "success" for r in self.records) else 1


@dataclass
class _Job:
    source: Source
    name: str


class _Progress:
    """Counts documents and pages; one line per finished document with pages/min and ETA."""

    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.log = total, log
        self.docs = self.pages = 0
        self.start = time.perf_counter()
        self.lock = threading.Lock()

    def page(self) -> None:
        with self.lock:
            self.pages += 1

    def document(self, record: Record) -> None:
        with self.lock:
            self.docs += 1
            elapsed = time.perf_counter() - self.start
            rate = 60 * self.pages / elapsed if elapsed > 0 else 0.0
            eta = elapsed / self.docs * (self.total - self.docs)
            note = f": {record.error}" if record.error else ""
            self.log(
                f"[{self.docs}/{self.total}] {record.document}: {record.status}, {record.pages} page(s), "
                f"attempt {record.attempts}{note} | {self.pages} pages, {rate:.2f} pages/min, ETA {eta:.0f} s"
            )


def plan_jobs(inputs: list[str | Path]) -> list[_Job]:
    """One job per input file (``sources.list_sources``); the output name is the file's stem.

    Raises:
        BatchError: no input file, or two inputs with the same stem (their outputs would clash).
        SourceError: an input that does not exist or cannot be listed (``list_sources``).
    """
    sources = list_sources(inputs)
    if not sources:
        raise BatchError("no input files found")
    if clashes := output_clashes(sources):
        first, second = clashes[0]
        raise BatchError(f"{first} and {second} would both write {first.stem}/: rename one")
    by_name = {source.stem: source for source in sources}
    return [_Job(source, name) for name, source in by_name.items()]


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _publish(partial: Path, target: Path) -> None:
    """Move a complete output folder into place, replacing an earlier run's (renames only)."""
    if target.exists():
        old = partial.with_name(partial.name + ".old")
        os.rename(target, old)
        os.rename(partial, target)
        shutil.rmtree(old)
    else:
        os.rename(partial, target)


class _Runner:
    """The driver's state: the queue, the manifest, progress; ``drive`` is one actor's thread."""

    def __init__(self, config: BatchConfig, jobs: list[_Job], log: Callable[[str], None],
                 on_event: Callable[[dict[str, Any]], None] | None) -> None:  # fmt: skip
        self.config, self.log, self.on_event = config, log, on_event
        self.manifest = Manifest(config.output)
        self.queue: queue.Queue[_Job] = queue.Queue()
        for job in jobs:
            self.queue.put(job)
        self.progress = _Progress(len(jobs), log)
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # set when the driver is interrupted

    def drive(self, actor: Any) -> None:
        while not self.stopping.is_set():
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            try:
                record = self._parse(actor, job)
            except Exception as exc:  # e.g. OSError writing OUTPUT: recorded, never lost
                record = Record(job.source.location, job.name, "error", 0, f"{type(exc).__name__}: {exc}", 1, 0.0)
            if self.stopping.is_set():
                return  # interrupted: the document is left to --resume
            self.manifest.append(record)
            with self.lock:
                self.records.append(record)
            self.progress.document(record)

    def _trace(self, job: _Job) -> Trace | None:
        if self.config.replay is None:
            return None
        return load_trace(self.config.replay / f"{job.name}.json")

    def _parse(self, actor: Any, job: _Job) -> Record:
        import ray

        start = time.perf_counter()
        location = job.source.location
        try:  # a URI document is read by its actor; a local one here (the nodes share no file system)
            data: Any = job.source if job.source.filesystem is not None else ray.put(job.source.read())
            trace = self._trace(job)
        except MineruFastError as exc:
            return Record(location, job.name, "error", 0, f"{type(exc).__name__}: {exc}", 1, 0.0)
        error = None
        attempts = 0
        for attempt in range(1, self.config.max_retries + 2):
            attempts = attempt
            partial = self.config.output / PARTIAL / f"{job.name}.{attempt}"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            try:
                if attempt > 1:
                    _wait_alive(actor)
                method = actor.parse.options(num_returns="streaming", _generator_backpressure_num_objects=BACKPRESSURE)
                for ref in method.remote(job.name, data, trace, self.config.pages, self.config.password):
                    event = ray.get(ref)
                    _write_files(partial, event.get("files", {}))
                    if self.on_event is not None:
                        self.on_event({**event, "files": None, "document": job.name, "attempt": attempt,
                                       "actor": actor})  # fmt: skip
                    if event["kind"] == "page":
                        self.progress.page()
                    elif event["kind"] == "error":  # unreadable input: final
                        shutil.rmtree(partial, ignore_errors=True)
                        return Record(location, job.name, "error", 0, event["error"], attempt, 0.0)
                    else:
                        _publish(partial, self.config.output / job.name)
                        wall = round(time.perf_counter() - start, 3)
                        return Record(location, job.name, event["status"], event["pages"], None, attempt, wall)
                error = "the actor ended the document without a result"
            except ray.exceptions.RayError as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                self.log(f"{location}: attempt {attempt} failed ({error})")
            shutil.rmtree(partial, ignore_errors=True)
        wall = round(time.perf_counter() - start, 3)
        return Record(location, job.name, "error", 0, error, attempts, wall)


def _wait_alive(actor: Any) -> None:
    """Wait until a restarting actor answers again (calls made while it restarts fail at once).

    Raises:
        ray.exceptions.RayError: it died for good, or is still unavailable after ``RESTART_TIMEOUT_S``.
    """
    import ray

    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            ray.get(actor.describe.remote(), timeout=RESTART_TIMEOUT_S)
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _cores_per_actor(config: BatchConfig) -> int:
    import ray

    if config.cores_per_actor is not None:
        return config.cores_per_actor
    per_node = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]]
    return max(1, min((c for c in per_node if c > 0), default=1))


def run_batch(
    config: BatchConfig,
    log: Callable[[str], None] = lambda line: print(f"mineru-fast batch: {line}", file=sys.stderr, flush=True),
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Parse ``config.inputs`` on Ray into ``config.output`` (see the module docstring).

    Connects to ``config.address``, or uses the Ray already initialized in this process, or starts
    a local one (shut down again at the end).

    Args:
        config: inputs, output, model and cluster layout.
        log: receives progress and retry lines.
        on_event: called in the driver with each actor event (``files`` left out) plus
            ``document``, ``attempt`` and ``actor`` (the actor handle); tests use it to kill actors.

    Returns:
        The ``BatchSummary``; every input ends in the manifest, parsed or with its error.

    Raises:
        BatchError: no inputs, clashing output names, ``max_retries`` < 0, or actors that fail to
            start (e.g. a wrong model path).
        SourceError: an input that does not exist, or a URI that cannot be listed.
        RayDependencyError: Ray is not installed.
    """
    require_ray()
    import ray

    if config.max_retries < 0:
        raise BatchError(f"--max-retries must be >= 0, got {config.max_retries}")
    jobs = plan_jobs(config.inputs)
    shutil.rmtree(config.output / PARTIAL, ignore_errors=True)  # left by an interrupted run
    skipped = []
    if config.resume:
        complete = Manifest(config.output).complete()
        skipped = [job.source.location for job in jobs if job.name in complete]
        jobs = [job for job in jobs if job.name not in complete]
        log(f"resume: {len(skipped)} document(s) complete, {len(jobs)} left")
    start = time.perf_counter()
    if not jobs:
        return BatchSummary([], skipped, 0.0, 0)
    started = False
    if not ray.is_initialized():
        if config.address is None:
            from ..cpu import read_topology

            ray.init(num_cpus=read_topology().usable_cores, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=config.address, log_to_driver=False)
        started = True
    try:
        cores = _cores_per_actor(config)
        count = config.actors or max(1, int(ray.cluster_resources().get("CPU", 1)) // cores)
        count = min(count, len(jobs))
        log(f"{len(jobs)} document(s) on {count} actor(s) x {cores} core(s)")
        remote: Any = ray.remote(num_cpus=cores, max_restarts=-1, max_task_retries=0)(DocumentWorker)
        actors: list[Any] = [remote.remote(config.model, config.options, cores, pin=True) for _ in range(count)]
        runner = _Runner(config, jobs, log, on_event)
        try:
            try:
                hosts = ray.get([a.describe.remote() for a in actors])
            except ray.exceptions.RayError as exc:
                raise BatchError(f"the parser actors failed to start: {exc}") from exc
            log("actors on " + ", ".join(sorted({h["host"] for h in hosts})))
            for n, h in enumerate(hosts):
                if h["cpus"] is not None:
                    log(f"actor {n} on {h['host']}: pinned to CPUs {h['cpus']} (NUMA node {h['node']})")
            threads = [threading.Thread(target=runner.drive, args=(a,), name=f"batch-{n}", daemon=True)
                       for n, a in enumerate(actors)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)  # wakes for Ctrl-C
        finally:
            runner.stopping.set()  # on an interrupt, no record is written for what is left
            for a in actors:
                ray.kill(a)
    finally:
        if started:
            ray.shutdown()
    shutil.rmtree(config.output / PARTIAL, ignore_errors=True)
    return BatchSummary(runner.records, skipped, time.perf_counter() - start, count)
