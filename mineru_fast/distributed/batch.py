"""``mineru-fast batch``: parse a collection of documents on a Ray cluster (or a local Ray).

Each of ``actors`` Ray actors (``worker.DocumentWorker``, ``num_cpus=cores_per_actor``) holds one
parser with that many threads (pinned to one NUMA node where the machine has several:
``placement``). The driver gives every actor a thread that takes the next item from one shared
queue: a new document, or a task of a document already started (tasks first, oldest document
first), so each actor runs one thing at a time and work is balanced as tasks finish.

A new document is first inspected on an actor (its selected pages and metadata block), then split
into tasks of at most ``pages_per_task`` pages (``assembly.split_pages``) that run on whichever
actors are free. A local document's bytes are put in Ray's object store once and shared by its
tasks; a URI document (``sources``) is read by each actor that runs a task of it. Page images
travel back page by page (a streaming actor method, with backpressure), the pages when their task
completes; the driver writes the document in page order (``assembly.DocumentAssembly``), so the
machines need no shared file system and only the driver writes ``OUTPUT``.

Outputs are atomic: a document is written under ``OUTPUT/.partial/<name>/`` and renamed to
``OUTPUT/<name>/`` once every task is in; then its record is appended to ``OUTPUT/manifest.jsonl``
(``manifest``). An actor that dies (killed, out of memory, node lost) is restarted by Ray
(``max_restarts=-1``); the task it held runs again, up to ``max_retries`` more times; a task that
still fails turns its pages into ``failure`` pages (the document is ``partial``, the record lists
``failed_pages``), or, when every task of the document failed, the document is recorded as
``error`` with the last error. An input that cannot be read (``InputError``) is recorded as
``error`` at once: retrying would not change it. ``resume`` skips documents whose outputs are
complete. Progress: a line per document with pages/min and an ETA.
"""

from __future__ import annotations

import heapq
import itertools
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
from . import PAGES_PER_TASK, require_ray
from .assembly import PARTIAL, DocumentAssembly, page_spec, split_pages
from .manifest import Manifest, Record
from .sources import Source, list_sources
from .worker import DocumentWorker

__all__ = ["BatchConfig", "BatchError", "BatchSummary", "run_batch"]

RESTART_TIMEOUT_S = 600.0  # longest wait for a restarted actor (it loads the model again)
BACKPRESSURE = 2  # page events an actor may run ahead of the driver (bounds the object store's share)


class BatchError(MineruFastError):
    """A batch that cannot start: no inputs, clashing output names, actors that fail to load."""

    code = "batch_not_started"


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
        max_retries: further attempts of a task (or an inspection) whose actor died or raised.
        resume: skip documents complete in the manifest and on disk.
        replay: trace directory of ``<stem>.json`` (tests, benchmarks) or None.
        pages / password: as ``DocumentParser.iter_pages``, for every input.
        pages_per_task: the most pages of one task: a document with more selected pages is split
            into tasks of this many consecutive pages that run on different actors.
        confidence: add the ``mf_confidence`` extension field to the content lists.
        quiet: log a document's line only when it did not end in ``success``.
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
    pages_per_task: int = PAGES_PER_TASK
    confidence: bool = False
    quiet: bool = False


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
    """Counts documents and pages; one line per finished document with pages/min and ETA (with
    ``quiet``, only for a document that did not end in ``success``)."""

    def __init__(self, total: int, log: Callable[[str], None], quiet: bool = False) -> None:
        self.total, self.log, self.quiet = total, log, quiet
        self.docs = self.pages = 0
        self.start = time.perf_counter()
        self.lock = threading.Lock()

    def page(self) -> None:
        with self.lock:
            self.pages += 1

    def document(self, record: Record) -> None:
        with self.lock:
            self.docs += 1
            if self.quiet and record.status == "success":
                return
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
        raise BatchError(f"{first.location} and {second.location} would both write {first.stem}/: rename one")
    by_name = {source.stem: source for source in sources}
    return [_Job(source, name) for name, source in by_name.items()]


@dataclass
class _Document:
    """A started document: what its tasks need, and its assembly."""

    job: _Job
    data: Any  # ObjectRef of a local document's bytes, or the Source of a URI document
    trace: Trace | None
    assembly: DocumentAssembly
    start: float
    closed: bool = False  # recorded: what is left of it is dropped


@dataclass
class _Task:
    document: _Document
    index: int


def _error(exc: BaseException) -> str:
    """``Type: first line of the message`` (Ray's messages run to tracebacks)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class _Runner:
    """The driver's state: the queue, the manifest, progress; ``drive`` is one actor's thread."""

    def __init__(self, config: BatchConfig, jobs: list[_Job], log: Callable[[str], None],
                 on_event: Callable[[dict[str, Any]], None] | None) -> None:  # fmt: skip
        self.config, self.log, self.on_event = config, log, on_event
        self.manifest = Manifest(config.output)
        # (priority, sequence, item): tasks of started documents (0) before new documents (1)
        self.queue: list[tuple[int, int, _Job | _Task]] = []
        self.sequence = itertools.count()
        self.changed = threading.Condition()
        self.unfinished = len(jobs)  # documents not yet recorded: a thread waits for their tasks
        for job in jobs:
            self._push(1, job)
        self.progress = _Progress(len(jobs), log, config.quiet)
        self.records: list[Record] = []
        self.stopping = threading.Event()  # set when the driver is interrupted

    def _push(self, priority: int, item: _Job | _Task) -> None:
        with self.changed:
            heapq.heappush(self.queue, (priority, next(self.sequence), item))
            self.changed.notify_all()

    def _next(self) -> _Job | _Task | None:
        """The next item; None when every document is recorded (or the run is interrupted)."""
        with self.changed:
            while not self.stopping.is_set():
                if self.queue:
                    return heapq.heappop(self.queue)[2]
                if self.unfinished == 0:
                    return None
                self.changed.wait(timeout=0.5)  # another thread's document may add tasks
            return None

    def drive(self, actor: Any) -> None:
        while (item := self._next()) is not None:
            try:
                if isinstance(item, _Job):
                    self._start(actor, item)
                else:
                    self._run(actor, item)
            except Exception as exc:  # e.g. OSError writing OUTPUT: the document is recorded, never lost
                job = item if isinstance(item, _Job) else item.document.job
                record = Record(job.source.location, job.name, "error", 0, f"{type(exc).__name__}: {exc}", 1, 0.0)
                self._close(None if isinstance(item, _Job) else item.document, record)

    def _close(self, document: _Document | None, record: Record) -> None:
        """Record a document once (``document`` None: it never started, nothing else records it)."""
        with self.changed:
            if document is not None:
                if document.closed:
                    return
                document.closed = True
        self._record(record)

    def _record(self, record: Record) -> None:
        """A document's end: its manifest line (none once interrupted: it is left to --resume)."""
        if not self.stopping.is_set():
            try:
                self.manifest.append(record)
            except OSError as exc:
                self.log(f"{record.document}: cannot write the manifest ({exc}); record: {record}")
            self.progress.document(record)
        with self.changed:
            self.records.append(record)
            self.unfinished -= 1
            self.changed.notify_all()

    def _trace(self, job: _Job) -> Trace | None:
        if self.config.replay is None:
            return None
        return load_trace(self.config.replay / f"{job.name}.json")

    def _start(self, actor: Any, job: _Job) -> None:
        """Inspect a new document on ``actor`` and queue its tasks."""
        import ray

        start = time.perf_counter()
        location = job.source.location
        try:  # a URI document is read by its actors; a local one here (the nodes share no file system)
            data: Any = job.source if job.source.filesystem is not None else ray.put(job.source.read())
            trace = self._trace(job)
        except MineruFastError as exc:
            return self._close(None, Record(location, job.name, "error", 0, f"{type(exc).__name__}: {exc}", 1, 0.0))
        error = ""
        for attempt in range(1, self.config.max_retries + 2):
            try:
                _wait_alive(actor)
                info = ray.get(actor.inspect.remote(job.name, data, self.config.pages, self.config.password))
                break
            except ray.exceptions.RayError as exc:
                error = _error(exc)
                self.log(f"{location}: inspection, attempt {attempt} failed ({error})")
        else:
            return self._close(None, Record(location, job.name, "error", 0, error, attempt, 0.0))
        if "error" in info:  # unreadable input: final
            return self._close(None, Record(location, job.name, "error", 0, info["error"], attempt, 0.0))
        tasks = split_pages(info["pages"], self.config.pages_per_task)
        assembly = DocumentAssembly(self.config.output, job.name, tasks, info["metadata"], self.config.confidence)
        document = _Document(job, data, trace, assembly, start)
        if not tasks:  # nothing selected: written at once (an empty document, as parse writes it)
            return self._finish(document)
        for index in range(len(tasks)):
            self._push(0, _Task(document, index))

    def _run(self, actor: Any, task: _Task) -> None:
        """Run one task on ``actor``, retried up to ``max_retries`` more times; hand its outcome on."""
        import ray

        document, assembly = task.document, task.document.assembly
        if document.closed:  # recorded as error already (a task of it could not be handled)
            return
        spec = page_spec(assembly.tasks[task.index])
        location = document.job.source.location
        error, final = "", False
        for attempt in range(1, self.config.max_retries + 2):
            staged = assembly.staging(task.index, attempt)
            pages = []
            try:
                _wait_alive(actor)
                method = actor.parse.options(num_returns="streaming", _generator_backpressure_num_objects=BACKPRESSURE)
                for ref in method.remote(document.data, document.trace, spec, self.config.password):
                    event = ray.get(ref)
                    if self.on_event is not None:
                        self.on_event({**event, "files": None, "page": None, "document": document.job.name,
                                       "task": task.index, "attempt": attempt, "actor": actor})  # fmt: skip
                    if event["kind"] == "page":
                        _write_files(staged, event["files"])
                        pages.append(event["page"])
                    elif event["kind"] == "error":  # unreadable input: final
                        error, final = event["error"], True
                        break
                    else:
                        for _ in pages:
                            self.progress.page()
                        if assembly.complete(task.index, pages, staged, attempt):
                            self._finish(document)
                        return
                else:
                    error = "the actor ended the task without a result"
            except ray.exceptions.RayError as exc:
                error = _error(exc)
                self.log(f"{location}: pages {spec}, attempt {attempt} failed ({error})")
            except Exception as exc:  # e.g. OSError writing OUTPUT: the task fails, recorded, never lost
                error, final = f"{type(exc).__name__}: {exc}", True
            shutil.rmtree(staged, ignore_errors=True)
            if final:
                break
        if assembly.fail(task.index, error, attempt):
            self._finish(document)

    def _finish(self, document: _Document) -> None:
        """Every task is in: publish the outputs (or drop them when nothing parsed) and record."""
        assembly, job = document.assembly, document.job
        if document.closed:  # recorded as error meanwhile: its folder goes with OUTPUT/.partial
            return
        wall = round(time.perf_counter() - document.start, 3)
        if assembly.all_failed:
            assembly.discard()
            record = Record(job.source.location, job.name, "error", 0, assembly.error, assembly.attempts, wall)
        else:
            status, pages = assembly.finish(wall)
            failed = [p + 1 for p in assembly.failed_pages]
            error = f"pages {page_spec(assembly.failed_pages)} failed: {assembly.error}" if failed else None
            record = Record(job.source.location, job.name, status, pages, error, assembly.attempts, wall, failed)
        self._close(document, record)


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


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
        BatchError: no inputs, clashing output names, ``max_retries`` < 0, ``pages_per_task`` < 1,
            or actors that fail to start (e.g. a wrong model path).
        SourceError: an input that does not exist, or a URI that cannot be listed.
        RayDependencyError: Ray is not installed.
    """
    require_ray()
    import ray

    if config.max_retries < 0:
        raise BatchError(f"--max-retries must be >= 0, got {config.max_retries}")
    if config.pages_per_task < 1:
        raise BatchError(f"--pages-per-task must be >= 1, got {config.pages_per_task}")
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
