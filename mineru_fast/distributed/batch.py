"""``mineru-fast batch``: parse a collection of documents on a Ray cluster (or a local Ray), as a
Ray Data pipeline.

The pipeline (``ray.data``, unordered, consumed by the driver as its rows complete):

1. ``from_items``: one row per input document (``_Job``).
2. ``flat_map(_inspect)``: Ray Data CPU tasks, on the driver's node (``label_selector`` on its
   node id), so that they read the local files the driver was given (the nodes share no file
   system); a URI input (``sources``) is read there too, from its store. Each opens its document
   (``worker.inspect_document``: its selected pages) and splits it into tasks of at most
   ``pages_per_task`` pages (``assembly.split_pages``): one row per task (``_Task``), carrying a
   reference to the document, its ``Source``, never its bytes (a copy in each row: the rows of a
   6.2 MB PDF of 10,000 pages held 1.9 GB), its own pages and the document's selection as
   page-range text (never the whole document's page or task lists, so the rows of a document grow
   linearly in its pages). They reserve no CPU (``num_cpus=0``): the actors may hold every CPU of
   the cluster, and a task that waited for one would wait for ever. An unreadable input gives one
   ``error`` row instead.
3. ``map(_ParseTasks)`` on an actor pool (``ActorPoolStrategy``, ``actors`` actors of
   ``num_cpus=cores_per_actor``, one task in flight each): every actor holds one parser with that
   many threads (``worker.DocumentWorker``, pinned to one NUMA node where the machine has
   several: ``placement``) and turns one task row into one result row (``_Outcome``): the task's
   pages with their image files, or its failure. The actor reads the document the row names
   (``_document_bytes``: a local file through the ``_Ledger``, on the driver's node where the file
   is; a URI from its store), checks it against the SHA-256 its inspection took, and keeps it for
   its next task of the same document. Rows of one block each (``target_max_block_size`` of one
   byte), so every task is its own actor call and a long document runs on several actors.

The driver takes the result rows as they complete (``iter_rows``) and writes each document in page
order (``assembly.DocumentAssembly``) under ``OUTPUT/.partial/<name>/``, renamed to
``OUTPUT/<name>/`` once every task is in; then its record is appended to ``OUTPUT/manifest.jsonl``
(``manifest``). So the machines need no shared file system and only the driver writes ``OUTPUT``.

Failures. An actor that dies (killed, out of memory, node lost) is restarted by Ray (Ray Data's
``max_restarts=-1``) and Ray runs its task again on it (``max_task_retries``); a parse that raises
is tried again in the actor. A ``_Ledger`` actor on the driver's node counts the attempts of every
task, so whatever ended an attempt, the task is tried at most ``max_retries`` more times: the
attempt after the last one returns at once a ``failed`` row (Ray allows it one retry more than
``max_retries``). A task's result is one row, sent when the task ends, so an attempt cut short sends
nothing and the pages of a document come from exactly one attempt of each task. A failed task turns
its pages into ``failure`` pages (the document is ``partial``, the record lists ``failed_pages``),
or, when every task of the document failed, the document is recorded as ``error`` with the last
error. A task that Ray gives up on all the same (``max_errored_blocks=-1``: Ray Data logs its error
and the run goes on) is failed by the driver when the dataset is exhausted, with the ledger's count
of its attempts. An input that cannot be read (``InputError``) is recorded as ``error`` at once:
retrying would not change it; for the same reason a task whose actor cannot read its document
again, or finds it changed since its inspection (``SourceError``), fails at once. ``resume`` skips
documents whose outputs are complete. Progress: a line per document with pages/min and an ETA.

Numerics. Each result row carries its actor's result metadata, whose ``runtime`` names what the
actor runs (ISA class, precision, INT8 kernels), and the actors of one batch can differ (a node of
another CPU class runs oneDNN's vision INT8 on other instructions, and the language model's block
kernel on another path, whose arithmetic is the same). A document whose pages ran under more than
one runtime is written all the same,
and the mix is recorded (``assembly``): the outputs' ``metadata.runtimes`` and the manifest's
``runtimes`` list each runtime with its pages, and the driver logs the document, whatever
``quiet`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mineru_fast.distributed import PAGES_PER_TASK, init_ray, require_ray
from mineru_fast.distributed.assembly import PARTIAL, DocumentAssembly, page_spec, spec_pages, split_pages
from mineru_fast.distributed.manifest import Manifest, Record
from mineru_fast.distributed.reaper import MARKER_ENV
from mineru_fast.distributed.sources import Source, list_sources
from mineru_fast.distributed.worker import DocumentWorker, inspect_document
from mineru_fast.errors import MineruFastError, SourceError
from mineru_fast.inputs.paths import output_clashes
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.traces import Trace, load_trace
from mineru_fast.results.metadata import InputInfo
from mineru_fast.results.page import Page
from mineru_fast.runtime.cpu import read_topology
from mineru_fast.runtime.hub import resolve_model_info

__all__ = ["BatchConfig", "BatchError", "BatchSummary", "run_batch"]

ITEM = "item"  # the one column of the pipeline's rows: a pickled _Job, _Task or _Outcome
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id
WATCH_WAIT_S = 0.5  # the longest wait of the driver's fetch of page events (``on_event`` only)


class BatchError(MineruFastError):
    """A batch that cannot start (no inputs, clashing output names), or that Ray Data stopped (e.g.
    parser actors that fail to load)."""

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
        max_retries: further attempts of a task whose actor died or whose parse raised.
        resume: skip documents complete in the manifest and on disk.
        replay: trace directory of ``<stem>.json`` (tests, benchmarks) or None.
        pages / password: as ``DocumentParser.iter_pages``, for every input.
        pages_per_task: the most pages of one task: a document with more selected pages is split
            into tasks of this many consecutive pages that run on different actors.
        confidence: add the ``mf_confidence`` extension field (``writer.DocumentWriter``).
        layout: ``"mineru4"`` (MinerU 4's bundle in ``OUTPUT/<stem>/``) or ``"2.x"`` (``writer.LAYOUTS``).
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
    layout: str = "mineru4"
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


@dataclass(frozen=True)
class _Task:
    """One page-range task of a document: a row between inspection and parse.

    Attributes:
        name: the document's output stem.
        index: the task's index among the document's tasks (``split_pages`` of ``selection``).
        pages: the task's pages as 1-based page-range text (``page_spec``); ``""`` when the
            selection holds no page (one task then, which parses nothing: the metadata block).
        selection: the document's selected pages, as page-range text.
        source: the document, read by the actor (``_document_bytes``); its bytes never travel in
            the row.
        trace: replayed outputs of the whole document (tests, benchmarks) or None.
        info: the document's ``InputInfo`` without its ``pages`` (they are ``selection``); the
            actor's parser makes the metadata block of it, and checks the bytes it reads against
            its ``sha256``.
        started: ``time.time()`` when its inspection began, on the driver's node.
    """

    name: str
    index: int
    pages: str
    selection: str
    source: Source
    trace: Trace | None
    info: InputInfo
    started: float


@dataclass(frozen=True)
class _Outcome:
    """A result row: one task's outcome, or a document that could not be inspected.

    Attributes:
        name: the document's output stem.
        kind: ``done`` (the task's pages, their files in ``files``), ``failed`` (the task failed on
            every attempt, or the input turned out unreadable: ``error``) or ``error`` (the document
            could not be inspected: ``error``; nothing else of it comes).
        index / selection: as ``_Task`` (``error``: none).
        metadata: the result's metadata block, its ``input.pages`` left empty (the driver fills
            them in from ``selection``), its ``runtime`` that of the actor (the driver compares the
            tasks' runtimes: ``DocumentAssembly.runtimes``); ``error``: None.
        attempts: the attempts the task took (``error``: 1).
        started: as ``_Task``.
        actor: where the actor runs (``DocumentWorker.describe``), for the driver's log.
    """

    name: str
    kind: str
    index: int = 0
    selection: str = ""
    metadata: dict[str, Any] | None = None
    pages: list[Page] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    attempts: int = 1
    started: float = 0.0
    actor: dict[str, Any] | None = None


def _row(item: _Job | _Task | _Outcome) -> dict[str, Any]:
    return {ITEM: pickle.dumps(item)}


def _item(row: dict[str, Any]) -> Any:
    return pickle.loads(row[ITEM])


def _error(exc: BaseException) -> str:
    """``Type: first line of the message`` (Ray's messages run to tracebacks)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _inspect(
    row: dict[str, Any], replay: Path | None, pages: str | None, password: str | None, per_task: int, max_pages: int
) -> list[dict[str, Any]]:
    """The inspection stage (a Ray Data CPU task on the driver's node): a document's task rows, or
    its ``error`` row when it cannot be read (``SourceError``, ``InputError``, ``TraceError``)."""
    job: _Job = _item(row)
    started = time.time()
    try:
        data = job.source.read()
        trace = load_trace(replay / f"{job.name}.json") if replay is not None else None
        info = inspect_document(job.name, data, pages, password, max_pages)
    except MineruFastError as exc:
        return [_row(_Outcome(job.name, "error", error=f"{type(exc).__name__}: {exc}", started=started))]
    tasks = [page_spec(task) for task in split_pages(list(info.pages), per_task)] or [""]
    selection, info = page_spec(list(info.pages)), replace(info, pages=())
    return [_row(_Task(job.name, i, task, selection, job.source, trace, info, started)) for i, task in enumerate(tasks)]


def _lost(attempt: int) -> str:
    """The error of an attempt that began and never ended (the ledger's view of it)."""
    return f"Actor lost during attempt {attempt}: it died or became unreachable (killed, out of memory, its node lost)"


class _Ledger:
    """The attempts of every task (an asyncio Ray actor on the driver's node, no CPU), the actors'
    page events while the driver wants them (``on_event``), and the local inputs, read on the
    driver's node for actors on any node (``read``).

    A task is keyed by ``(document, task index)``. An attempt that began and reported no error is
    running, or, once another attempt begins or Ray gives up on the task, was cut short with its
    actor (``_lost``). A page's event returns to its actor only once the driver has handled it, so
    ``on_event`` acts at a known point of a task (tests kill the actor there).
    """

    def __init__(self) -> None:
        self.attempts: dict[tuple[str, int], int] = {}
        self.errors: dict[tuple[str, int], str] = {}
        self.running: set[tuple[str, int]] = set()
        self.events: list[dict[str, Any]] = []  # handed in, not yet taken by the driver
        self.sent = self.handled = 0  # events handed in / handled by the driver, counted from the start
        self.changed = asyncio.Condition()

    def begin(self, key: tuple[str, int]) -> tuple[int, str | None]:
        """Count a new attempt of ``key``: ``(its number, the last error of the task or None)``."""
        attempt = self.attempts.get(key, 0)
        if key in self.running:
            self.errors[key] = _lost(attempt)
        self.attempts[key] = attempt + 1
        self.running.add(key)
        return attempt + 1, self.errors.get(key)

    def fail(self, key: tuple[str, int], error: str) -> None:
        """The running attempt of ``key`` raised ``error``."""
        self.running.discard(key)
        self.errors[key] = error

    async def read(self, source: Source) -> bytes:
        """The bytes of a local input (read in a thread: the events go on meanwhile).

        Raises:
            SourceError: the file cannot be read.
        """
        return await asyncio.to_thread(source.read)

    def tasks(self, name: str) -> dict[int, tuple[int, str | None]]:
        """Each task of document ``name`` that began: ``index -> (attempts, last error or None)``."""
        began = [(key, n) for key, n in self.attempts.items() if key[0] == name]
        return {key[1]: (n, _lost(n) if key in self.running else self.errors.get(key)) for key, n in began}

    async def event(self, event: dict[str, Any]) -> None:
        """Hand a page's event to the driver; returns once the driver has handled it (``handled``)."""
        async with self.changed:
            self.events.append(event)
            self.sent += 1
            number = self.sent
            self.changed.notify_all()
            await self.changed.wait_for(lambda: self.handled >= number)

    async def take_events(self, timeout: float) -> list[dict[str, Any]]:
        """The events handed in since the last call, waiting up to ``timeout`` seconds for one."""
        async with self.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(lambda: bool(self.events)), timeout)
            events, self.events = self.events, []
            return events

    async def done(self, count: int) -> None:
        """The driver has handled ``count`` more events (in the order taken)."""
        async with self.changed:
            self.handled += count
            self.changed.notify_all()


def _document_bytes(task: _Task, ledger: Any) -> bytes:
    """The bytes of a task's document: a local file read by ``ledger`` (``_Ledger.read``, on the
    driver's node: the file is there only), a URI from its store, here.

    Raises:
        SourceError: the document cannot be read, or its bytes are not those its inspection read
            (their SHA-256 differs from ``task.info.sha256``: the file changed meanwhile).
    """
    if task.source.filesystem is not None:
        data = task.source.read()
    else:
        import ray

        try:
            data = ray.get(ledger.read.remote(task.source))
        except ray.exceptions.RayTaskError as exc:  # the ledger's SourceError, without Ray's traceback
            raise exc.cause from None
    if task.info.sha256 is not None and hashlib.sha256(data).hexdigest() != task.info.sha256:
        raise SourceError(f"{task.source.location} changed since it was inspected (its SHA-256 differs)")
    return data


class _ParseTasks:
    """The parse stage's actor (Ray Data builds the pool): one ``DocumentWorker``, pinned; a task
    row in, its ``_Outcome`` row out (an inspection ``error`` row passes through). It keeps the
    bytes of the last document it read (``_document_bytes``) for its next task of that document.

    Args:
        model / options / threads: as ``DocumentWorker`` (``pin=True``).
        ledger: the ``_Ledger`` actor.
        attempts: the most attempts of a task (``max_retries + 1``).
        password: as ``DocumentParser.iter_pages``.
        events: send each parsed page's event to the ledger (the driver has an ``on_event``).
        overlays: as ``DocumentWorker`` (the 2.x layout's overlays).
    """

    def __init__(
        self, model: str, options: ParserOptions, threads: int, ledger: Any, attempts: int,
        password: str | None, events: bool, overlays: bool = True,
    ) -> None:  # fmt: skip
        import ray

        self.worker = DocumentWorker(model, options, threads, pin=True, overlays=overlays)
        self.ledger, self.attempts, self.password, self.events = ledger, attempts, password, events
        self.actor = ray.get_runtime_context().current_actor
        self.where = self.worker.describe()
        self.document: tuple[str, bytes] | None = None  # (name, bytes) of the last document read

    def __call__(self, batch: Any) -> Any:
        """A batch of task rows (``pyarrow``; one row, as ``map_batches`` is asked) to their outcomes."""
        import pyarrow as pa

        outcomes = [pickle.dumps(self._run(pickle.loads(item))) for item in batch.column(ITEM).to_pylist()]
        return pa.table({ITEM: pa.array(outcomes, type=pa.large_binary())})

    def _run(self, task: _Task | _Outcome) -> _Outcome:
        import ray

        if isinstance(task, _Outcome):
            return task
        key = (task.name, task.index)
        metadata = self.worker.parser.result_metadata(task.info)
        outcome = _Outcome(task.name, "done", task.index, task.selection, metadata, started=task.started,
                           actor=self.where)  # fmt: skip
        pages = task.pages
        while True:
            attempt, error = ray.get(self.ledger.begin.remote(key))
            if attempt > self.attempts:  # the last allowed attempt failed: give up
                return replace(outcome, kind="failed", error=error, attempts=attempt - 1)
            if not pages:  # nothing selected: the metadata block alone
                return replace(outcome, attempts=attempt)
            report = self._reporter(task, attempt)
            try:
                result = self.worker.run_task(self._document(task), task.trace, pages, self.password, report)
            except SourceError as exc:  # unreadable now, or changed since its inspection: final
                return replace(outcome, kind="failed", error=_error(exc), attempts=attempt)
            except Exception as exc:  # tried again here, as long as attempts are left
                ray.get(self.ledger.fail.remote(key, _error(exc)))
                continue
            if "error" in result:  # unreadable input: final
                return replace(outcome, kind="failed", error=result["error"], attempts=attempt)
            return replace(outcome, pages=result["pages"], files=result["files"], attempts=attempt)

    def _document(self, task: _Task) -> bytes:
        """The bytes of the task's document: those kept from the last task, if of the same document.

        Raises:
            SourceError: as ``_document_bytes``.
        """
        if self.document is None or self.document[0] != task.name:
            self.document = None  # the last document's bytes go before the next one's come
            self.document = (task.name, _document_bytes(task, self.ledger))
        return self.document[1]

    def _reporter(self, task: _Task, attempt: int) -> Callable[[dict[str, Any]], None] | None:
        """What sends a page's event to the ledger (None: no driver wants events)."""
        if not self.events:
            return None

        def report(event: dict[str, Any]) -> None:
            import ray

            ray.get(self.ledger.event.remote({**event, "document": task.name, "task": task.index,
                                              "attempt": attempt, "actor": self.actor}))  # fmt: skip

        return report


@dataclass
class _Document:
    """A document the driver has heard of: its assembly (from its first result on)."""

    job: _Job
    started: float
    assembly: DocumentAssembly | None = None
    pending: set[int] = field(default_factory=set)  # tasks without a result yet
    closed: bool = False  # recorded: what is left of it is dropped


class _Runner:
    """The driver's state: the documents, the manifest, progress."""

    def __init__(self, config: BatchConfig, jobs: list[_Job], log: Callable[[str], None]) -> None:
        self.config, self.log = config, log
        self.jobs = {job.name: job for job in jobs}
        self.documents: dict[str, _Document] = {}
        self.manifest = Manifest(config.output)
        self.progress = _Progress(len(jobs), log, config.quiet)
        self.records: list[Record] = []
        self.actors: set[tuple[str, str | None]] = set()  # (host, cpus) of the actors seen

    def take(self, outcome: _Outcome) -> None:
        """One result row (see ``_Outcome``)."""
        job = self.jobs[outcome.name]
        document = self.documents.setdefault(outcome.name, _Document(job, outcome.started))
        if document.closed:
            return
        try:
            self._take(document, outcome)
        except Exception as exc:  # e.g. OSError writing OUTPUT: the document is recorded, never lost
            self._close(document, Record(job.source.location, job.name, "error", 0, _error(exc), 1, 0.0))

    def _take(self, document: _Document, outcome: _Outcome) -> None:
        job = document.job
        if outcome.kind == "error":
            record = Record(job.source.location, job.name, "error", 0, outcome.error, outcome.attempts, 0.0)
            return self._close(document, record)
        self._note_actor(outcome.actor)
        if document.assembly is None:
            assert outcome.metadata is not None  # a task's outcome has it
            selected = spec_pages(outcome.selection)
            metadata = {**outcome.metadata, "input": {**outcome.metadata["input"], "pages": selected}}
            tasks = split_pages(selected, self.config.pages_per_task)
            document.assembly = DocumentAssembly(
                self.config.output, job.name, tasks, metadata, self.config.confidence, self.config.layout
            )
            document.pending = set(range(len(tasks)))
            if not tasks:  # nothing selected: written at once (an empty document, as parse writes it)
                return self._finish(document)
        assembly = document.assembly
        document.pending.discard(outcome.index)
        if outcome.kind == "done":
            staged = assembly.staging(outcome.index, outcome.attempts)
            _write_files(staged, outcome.files)
            for _ in outcome.pages:
                self.progress.page()
            runtime = outcome.metadata["runtime"] if outcome.metadata is not None else None
            last = assembly.complete(outcome.index, outcome.pages, staged, outcome.attempts, runtime)
        else:
            location = job.source.location
            self.log(f"{location}: pages {page_spec(assembly.tasks[outcome.index])} failed ({outcome.error})")
            last = assembly.fail(outcome.index, outcome.error or "", outcome.attempts)
        if last:
            self._finish(document)

    def _note_actor(self, actor: dict[str, Any] | None) -> None:
        """Log each actor's place the first time one of its results comes in."""
        if actor is None or (actor["host"], actor["cpus"]) in self.actors:
            return
        self.actors.add((actor["host"], actor["cpus"]))
        pinned = f": pinned to CPUs {actor['cpus']} (NUMA node {actor['node']})" if actor["cpus"] is not None else ""
        self.log(f"an actor on {actor['host']}{pinned}")

    def lost(self, ledger: Any) -> None:
        """After the dataset: the documents and tasks Ray gave up on (no result row) end as failed."""
        import ray

        for name, job in self.jobs.items():
            document = self.documents.setdefault(name, _Document(job, time.time()))
            if document.closed:
                continue
            began = ray.get(ledger.tasks.remote(name))
            if document.assembly is None:  # no task of it came back, or its inspection was lost
                attempts = max((n for n, _ in began.values()), default=1)
                errors = [e for _, e in began.values() if e]
                error = errors[-1] if errors else "no result: Ray Data gave up on it (its log has the error)"
                self._close(document, Record(job.source.location, name, "error", 0, error, attempts, 0.0))
                continue
            for index in sorted(document.pending):
                attempts, error = began.get(index, (0, None))
                error = error or f"no result after {attempts} attempt(s): Ray Data gave up on it (see its log)"
                lost = _Outcome(name, "failed", index, error=error, attempts=max(attempts, 1))
                self.take(lost)

    def _close(self, document: _Document, record: Record) -> None:
        """Record a document once: its manifest line, progress."""
        if document.closed:
            return
        document.closed = True
        try:
            self.manifest.append(record)
        except OSError as exc:
            self.log(f"{record.document}: cannot write the manifest ({exc}); record: {record}")
        self.progress.document(record)
        self.records.append(record)

    def _finish(self, document: _Document) -> None:
        """Every task is in: publish the outputs (or drop them when nothing parsed) and record."""
        assembly, job = document.assembly, document.job
        assert assembly is not None
        wall = round(time.time() - document.started, 3)
        if assembly.all_failed:
            assembly.discard()
            record = Record(job.source.location, job.name, "error", 0, assembly.error, assembly.attempts, wall)
        else:
            if runtimes := assembly.runtimes:
                self.log(f"{job.source.location}: {_mix(runtimes)}")
            status, pages = assembly.finish(wall)
            failed = [p + 1 for p in assembly.failed_pages]
            error = f"pages {page_spec(assembly.failed_pages)} failed: {assembly.error}" if failed else assembly.problem
            ran = [{"pages": [p + 1 for p in r["pages"]], "runtime": r["runtime"]} for r in runtimes]
            record = Record(job.source.location, job.name, status, pages, error, assembly.attempts, wall, failed, ran)
        self._close(document, record)


def _mix(runtimes: list[dict[str, Any]]) -> str:
    """The driver's line on a document whose pages ran under more than one runtime
    (``DocumentAssembly.runtimes``): which pages, and what differs between the runtimes."""
    keys = sorted({key for r in runtimes for key in r["runtime"]})
    differ = [key for key in keys if len({repr(r["runtime"].get(key)) for r in runtimes}) > 1]
    ranges = " / ".join(page_spec(r["pages"]) for r in runtimes)
    return (f"mixed numerics: pages {ranges} ran under different runtimes ({', '.join(differ)} differ); "
            "recorded in its metadata.runtimes and the manifest's runtimes")  # fmt: skip


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _cores_per_actor(config: BatchConfig) -> int:
    import ray

    if config.cores_per_actor is not None:
        return config.cores_per_actor
    per_node = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]]
    return max(1, min((c for c in per_node if c > 0), default=1))


def _local(job: _Job) -> _Job:
    """A local input with an absolute path: the inspection task runs in another directory."""
    if job.source.filesystem is not None:
        return job
    return replace(job, source=replace(job.source, path=str(Path(job.source.path).absolute())))


def _pipeline(config: BatchConfig, jobs: list[_Job], actors: int, cores: int, ledger: Any, events: bool) -> Any:
    """The dataset of result rows (see the module docstring); built under the run's ``DataContext``."""
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
    replay = config.replay.absolute() if config.replay is not None else None
    documents = ray.data.from_items([_row(_local(job)) for job in jobs], override_num_blocks=len(jobs))
    pages, password, per_task = config.pages, config.password, config.pages_per_task
    max_pages = config.options.max_pages

    def inspect(row: dict[str, Any]) -> list[dict[str, Any]]:
        return _inspect(row, replay, pages, password, per_task, max_pages)

    tasks = documents.flat_map(
        inspect,
        num_cpus=0,
        compute=TaskPoolStrategy(size=min(actors, len(jobs))),  # inspections at once
        label_selector=here,
    )
    with warnings.catch_warnings():  # Ray 2.60 names no parameter for max_task_retries yet
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return tasks.map_batches(
            _ParseTasks,
            batch_size=1,
            batch_format="pyarrow",
            fn_constructor_kwargs={
                "model": config.model,
                "options": config.options,
                "threads": cores,
                "ledger": ledger,
                "attempts": config.max_retries + 1,
                "password": config.password,
                "events": events,
                "overlays": config.layout == "2.x",  # MinerU 4's bundle has no overlays
            },
            compute=ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            num_cpus=cores,
            max_task_retries=config.max_retries + 1,  # the last one only returns the task's failure
        )


def _context() -> Any:
    """The ``DataContext`` of a run: the current one, changed as the module docstring says."""
    from ray.data import DataContext

    with warnings.catch_warnings():  # the copy sets Ray's deprecated fields too, each with a warning
        warnings.simplefilter("ignore", DeprecationWarning)
        context = DataContext.get_current().copy()
    context.target_max_block_size = 1  # a block per row: every task is its own actor call
    context.max_errored_blocks = -1  # a task Ray gives up on is logged and left out, not the end of the run
    context.execution_options.preserve_order = False  # results as they complete
    context.enable_progress_bars = False  # the driver logs a line per document
    context.print_on_execution_start = False
    context.enable_auto_log_stats = False
    return context


def run_batch(
    config: BatchConfig,
    log: Callable[[str], None] = lambda line: print(f"mineru-fast batch: {line}", file=sys.stderr, flush=True),
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Parse ``config.inputs`` on Ray into ``config.output`` (see the module docstring).

    Connects to ``config.address``, or uses the Ray already initialized in this process, or starts
    a local one (shut down again at the end; a ``reaper`` process ends what is left of it when the
    driver is killed).

    Args:
        config: inputs, output, model and cluster layout.
        log: receives progress and failure lines.
        on_event: called in the driver (from a thread of its own) with each page an actor parsed:
            ``{"kind": "page", "index", "status", "files": None, "page": None}`` plus ``document``,
            ``task``, ``attempt`` and ``actor`` (the actor handle); the actor goes on once it has
            returned. Tests use it to kill actors at a known page.

    Returns:
        The ``BatchSummary``; every input ends in the manifest, parsed or with its error.

    Raises:
        BatchError: no inputs, clashing output names, ``max_retries`` < 0, ``pages_per_task`` < 1,
            or a pipeline that Ray Data stopped (e.g. actors that fail to load: a wrong model path);
            the documents recorded until then stay recorded.
        SourceError: an input that does not exist, or a URI that cannot be listed.
        ModelLoadError: without ``address``, a model this machine cannot load (checked before Ray
            starts).
        RayDependencyError: Ray is not installed.
    """
    require_ray()
    import ray
    from ray.data import DataContext
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

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
    if config.address is None:  # the actors run here: a model they cannot load fails now, not in each actor
        resolve_model_info(config.model)
    started, reaper = not ray.is_initialized(), None
    if started and config.address is None:
        reaper = _local_ray()
    elif started:
        init_ray(config.address, log_to_driver=False)
    try:
        cores = _cores_per_actor(config)
        count = config.actors or max(1, int(ray.cluster_resources().get("CPU", 1)) // cores)
        log(f"{len(jobs)} document(s) on {count} actor(s) x {cores} core(s)")
        node = ray.get_runtime_context().get_node_id()
        ledger: Any = ray.remote(num_cpus=0)(_Ledger).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()  # fmt: skip
        runner = _Runner(config, jobs, log)
        stop = threading.Event()
        watcher = None
        if on_event is not None:
            watcher = threading.Thread(
                target=_watch, args=(ledger, on_event, log, stop), name="batch-events", daemon=True
            )
            watcher.start()
        try:
            with DataContext.current(_context()):
                results = _pipeline(config, jobs, count, cores, ledger, on_event is not None)
                try:
                    for row in results.iter_rows():
                        runner.take(_item(row))
                except ray.exceptions.RayError as exc:
                    raise BatchError(f"Ray Data stopped the batch ({len(runner.records)} of {len(jobs)} "
                                     f"document(s) recorded): {_error(exc)}") from exc  # fmt: skip
            runner.lost(ledger)
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
            ray.kill(ledger)
    finally:
        if started:
            ray.shutdown()
        if reaper is not None:
            reaper.stdin.close()  # type: ignore[union-attr]  # the reaper ends what shutdown left
    shutil.rmtree(config.output / PARTIAL, ignore_errors=True)
    return BatchSummary(runner.records, skipped, time.perf_counter() - start, count)


def _local_ray() -> subprocess.Popen:
    """Start a local Ray for this driver, watched by a reaper (``reaper``): whatever ends the
    driver, even SIGKILL, none of Ray's processes outlives it. Returns the reaper (close its stdin
    after ``ray.shutdown``)."""
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "mineru_fast.distributed.reaper", marker]
    reaper = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
    os.environ[MARKER_ENV] = marker  # inherited by every process Ray starts
    try:
        init_ray(None, log_to_driver=False, num_cpus=read_topology().usable_cores)
    finally:
        del os.environ[MARKER_ENV]  # and by nothing this driver starts later
    return reaper


def _watch(
    ledger: Any, on_event: Callable[[dict[str, Any]], None], log: Callable[[str], None], stop: threading.Event
) -> None:
    """Hand the actors' page events to ``on_event`` (each actor waits for it) until ``stop``."""
    import ray

    while not stop.is_set():
        events = ray.get(ledger.take_events.remote(WATCH_WAIT_S))
        for event in events:
            try:
                on_event(event)
            except Exception as exc:  # the actor waits for the event all the same
                log(f"on_event raised {_error(exc)}")
        if events:
            ledger.done.remote(len(events))
