"""The driver's side of a document in ``mineru-fast batch``: its tasks and the outputs assembled from them.

A document's selected pages are split into tasks of at most ``pages_per_task`` consecutive pages
(``split_pages``), which run on any actors. A task's pages arrive together in its one result, in any
order among the tasks; ``DocumentAssembly`` writes the pages of the completed tasks in page order
with one ``writer.DocumentWriter``, the writer of sequential ``mineru-fast parse``, so the outputs
are the same bytes however the document was split.

Layout under ``OUTPUT/.partial/<name>/``: ``doc/`` is the document's output folder while it is
written (renamed to ``OUTPUT/<name>/`` by ``finish``); ``task.<i>.<attempt>/`` receives the image
files of task ``i``'s result (of the attempt that completed it), and they move into ``doc/`` when
its pages are taken (``complete``).

A task that failed on every attempt adds one ``failure`` page per page it held (error code
``batch_task_failed``, the task's last error), so the document is ``partial`` (or ``failure`` when
nothing else parsed) and never looks complete; ``failed_pages`` lists them. The problems of the
other pages that did not end in ``success`` (a page the model could not read) are summed up in
``problem`` for the manifest's ``error`` and the progress line, as ``parse`` prints them.

Each completed task names the runtime its actor ran (its result metadata's ``runtime``: ISA class,
precision, INT8 kernels), and the actors of one batch can differ (a node of another CPU class, an
actor restarted after its block-wise INT8 kernel failed to load runs per-channel INT8). The
document's metadata claims the runtime of its first parsed page; when its pages ran under more
than one, ``runtimes`` lists each with its pages (``metadata.runtimes`` of the outputs), so a mix is
recorded, never hidden behind one runtime.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

from mineru_fast.results.page import Page, ParseError
from mineru_fast.results.writer import DocumentWriter
from mineru_fast.runtime.cpu import format_cpulist, parse_cpulist

__all__ = ["PARTIAL", "TASK_FAILED", "DocumentAssembly", "page_spec", "split_pages"]

PARTIAL = ".partial"
TASK_FAILED = "batch_task_failed"  # ParseError code of a page whose task failed on every attempt


def split_pages(pages: list[int], per: int) -> list[list[int]]:
    """``pages`` (0-based, in order) cut into tasks of at most ``per`` pages (``[[0, 1], [2, 3], [4]]``
    for five pages, ``per=2``); no pages give no task.

    Raises:
        ValueError: ``per`` < 1.
    """
    if per < 1:
        raise ValueError(f"pages per task must be >= 1, got {per}")
    return [pages[i : i + per] for i in range(0, len(pages), per)]


def page_spec(pages: list[int]) -> str:
    """0-based page indices as a 1-based page range (``[0, 1, 2, 4]`` -> ``"1-3,5"``), the syntax of
    ``--pages``, which is the kernel's cpulist syntax."""
    return format_cpulist([p + 1 for p in pages])


def spec_pages(spec: str) -> list[int]:
    """``page_spec``'s inverse: ``"1-3,5"`` -> ``[0, 1, 2, 4]``; ``""`` -> ``[]``."""
    return [page - 1 for page in parse_cpulist(spec)]


def _first_problem(page: Page) -> str:
    """``code: message`` of a page's first error, else its first warning (a partial page)."""
    if page.errors:
        return str(page.errors[0])
    return page.warnings[0] if page.warnings else page.status


def _move_files(source: Path, target: Path) -> None:
    """Move every file below ``source`` to the same relative path below ``target`` (renames)."""
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)


def _publish(partial: Path, target: Path) -> None:
    """Move a complete output folder into place, replacing an earlier run's (renames only)."""
    if target.exists():
        old = partial.with_name(partial.name + ".old")
        os.rename(target, old)
        os.rename(partial, target)
        shutil.rmtree(old)
    else:
        os.rename(partial, target)


class DocumentAssembly:
    """One document's outputs, written in page order from its tasks' pages (thread-safe).

    Args:
        output: the batch output directory.
        name: the document's output stem.
        tasks: its tasks' 0-based page indices (``split_pages``).
        metadata: the result's metadata block (the parse actor's ``DocumentParser.result_metadata``;
            copied: ``finish`` sets its ``runtime`` and ``runtimes``).
        confidence: add the ``mf_confidence`` extension field (``DocumentWriter``).
        layout: the ``DocumentWriter`` layout, ``"mineru4"`` or ``"2.x"``.
    """

    def __init__(
        self,
        output: Path,
        name: str,
        tasks: list[list[int]],
        metadata: dict[str, Any],
        confidence: bool = False,
        layout: str = "mineru4",
    ) -> None:
        self.output, self.name, self.tasks = output, name, tasks
        self.root = output / PARTIAL / name
        shutil.rmtree(self.root, ignore_errors=True)
        self.metadata = dict(metadata)  # the writer's: it writes the block when it closes
        self.writer = DocumentWriter(
            self.root / "doc", name, layout=layout, metadata=self.metadata, confidence=confidence
        )
        self.failed_pages: list[int] = []  # 0-based, pages of tasks that failed on every attempt
        self.error: str | None = None  # the last error of a failed task
        self.attempts = 0  # the most attempts any task took
        self.problem_pages: list[tuple[int, str]] = []  # 0-based page, its first problem (parsed pages)
        self._ready: dict[int, list[Page] | str] = {}  # finished tasks not yet written (str: failed, its error)
        self._runtimes: dict[int, dict[str, Any]] = {}  # completed task -> the runtime its pages ran under
        self._next = 0  # the first task not yet written
        self._lock = threading.Lock()

    def staging(self, task: int, attempt: int) -> Path:
        """An empty folder for the files of one attempt of ``task``."""
        folder = self.root / f"task.{task}.{attempt}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def complete(
        self, task: int, pages: list[Page], staged: Path, attempt: int, runtime: dict[str, Any] | None = None
    ) -> bool:
        """Take a completed task: its files (``staged``) move into the document, its pages are
        written once every earlier task is.

        Args:
            task: the task's index in ``tasks``.
            pages: its pages in order, without their images (their files are in ``staged``).
            staged: the attempt's folder (``staging``); removed.
            attempt: the attempt that completed (1 = first).
            runtime: the runtime its pages ran under (the actor's result metadata's ``runtime``);
                None: not known, left out of ``runtimes``.

        Returns:
            True when this was the document's last task (call ``finish``).
        """
        with self._lock:
            _move_files(staged, self.writer.out)
            shutil.rmtree(staged)
            if runtime is not None:
                self._runtimes[task] = runtime
            return self._take(task, pages, attempt)

    def fail(self, task: int, error: str, attempt: int) -> bool:
        """Give up on ``task`` after ``attempt`` attempts: its pages become ``failure`` pages.

        Returns:
            True when this was the document's last task (call ``finish``).
        """
        with self._lock:
            self.error = error
            return self._take(task, error, attempt)

    def _take(self, task: int, outcome: list[Page] | str, attempt: int) -> bool:
        self.attempts = max(self.attempts, attempt)
        self._ready[task] = outcome
        while self._next in self._ready:
            ready, pages = self._ready.pop(self._next), self.tasks[self._next]
            if isinstance(ready, str):
                message = f"pages {page_spec(pages)} failed on every attempt: {ready}"
                ready = [Page(i, status="failure", errors=[ParseError(TASK_FAILED, message, i)]) for i in pages]
                self.failed_pages.extend(pages)
            else:
                self.problem_pages.extend((p.index, _first_problem(p)) for p in ready if p.status != "success")
            for page in ready:
                self.writer.add_page(page)
            self._next += 1
        return self._next == len(self.tasks)

    @property
    def problem(self) -> str | None:
        """The first problem of the parsed pages that did not end in ``success``, with its page
        (1-based) and how many other pages had one; None when there was none."""
        if not self.problem_pages:
            return None
        index, problem = self.problem_pages[0]
        more = len(self.problem_pages) - 1
        return f"page {index + 1}: {problem}" + (f" (and {more} more page(s))" if more else "")

    @property
    def runtimes(self) -> list[dict[str, Any]]:
        """The runtimes the completed tasks' pages ran under when they are more than one, each as
        ``{"pages": [0-based page, ...], "runtime": {...}}``, in the order of their first page;
        ``[]`` when every page ran under one runtime (or none is known)."""
        groups: list[dict[str, Any]] = []
        for task, runtime in sorted(self._runtimes.items()):
            group = next((g for g in groups if g["runtime"] == runtime), None)
            if group is None:
                group = {"pages": [], "runtime": runtime}
                groups.append(group)
            group["pages"].extend(self.tasks[task])
        return groups if len(groups) > 1 else []

    @property
    def all_failed(self) -> bool:
        """Every task failed (nothing parsed: the document gets no outputs)."""
        return bool(self.tasks) and len(self.failed_pages) == sum(map(len, self.tasks))

    def finish(self, wall_s: float) -> tuple[str, int]:
        """Close the outputs and move them to ``OUTPUT/<name>/`` (replacing an earlier run's).

        Args:
            wall_s: the document's wall-clock seconds (``timings["wall"]`` of its JSON).

        Returns:
            ``(document status, pages written)``.
        """
        if self._runtimes:  # the first parsed page's, not that of whichever result came in first
            self.metadata["runtime"] = self._runtimes[min(self._runtimes)]
        if runtimes := self.runtimes:
            self.metadata["runtimes"] = runtimes
        self.writer.close(wall_s=wall_s)
        _publish(self.writer.out, self.output / self.name)
        shutil.rmtree(self.root, ignore_errors=True)
        assert self.writer.document_status is not None  # set by close
        return self.writer.document_status, len(self.writer.statuses)

    def discard(self) -> None:
        """Drop everything written (the document is recorded as ``error``)."""
        self.writer.close()
        shutil.rmtree(self.root, ignore_errors=True)
