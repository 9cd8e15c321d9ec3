"""Every code example of README.md and the documentation site (docs/) runs, or says why it cannot.

Each fenced block of those Markdown files is one of:

- ``python``: executed. The blocks of one page run in order in one namespace, as a reader would
  run them in one session, so a later block may use what an earlier one made.
- ``bash`` (or ``console``, ``shell``, ``sh``): every command runs, in this process
  (``mineru_fast.cli.main.main``: the ``mineru-fast`` console script without a new interpreter)
  and must exit 0. Only ``mineru-fast ...`` and ``python -m mineru_fast ...`` commands, joined by
  ``&&`` or on separate lines, can run; a command already run with the same text is not run again
  (the README repeats commands of the site).
- ``text`` starting with ``mineru-fast``: a usage synopsis; every option it names must be an
  option of that command's parser (``mineru-fast launch ... -- parse ...``: the part after ``--`` is
  checked as ``parse``).
- ``json``: parsed.

Any other block, or one of the kinds above that cannot run here (it needs real weights, a server,
Docker, Ray, an install), must be marked on the line before its opening fence with
``<!-- docs-test: skip (the reason) -->``; an unmarked block that would not run fails the test,
and so does a marker that is not followed by a block.

The examples run in a scratch folder holding the repository's ``examples/`` and ``models/tiny``,
the tiny synthetic model (made once for this module), as the examples expect from the current
directory; their outputs (``out/`` and so on) go there too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELLS = ("bash", "console", "shell", "sh")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None  # the reason of its skip marker, None when unmarked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def read_blocks(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``page``, and the places of skip markers that precede no block."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    stray: list[str] = []
    pending: tuple[int, str] | None = None  # a skip marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = FENCE.match(line)
        marker = SKIP.search(line)
        if opening:
            fence, indent = opening["fence"], len(opening["indent"])
            closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
            body: list[str] = []
            i += 1
            while i < len(lines) and not closing.match(lines[i]):
                text = lines[i]  # a fence indented in a list: its lines lose that indent
                body.append(text[indent:] if not text[:indent].strip() else text.lstrip())
                i += 1
            language = (opening["info"].strip().split() or [""])[0].lower()
            start = i - len(body)
            blocks.append(Block(page, start, language, "\n".join(body) + "\n", pending[1] if pending else None))
            pending = None
        elif marker:
            if pending:
                stray.append(f"{page.relative_to(REPO)}:{pending[0]}")
            pending = (i + 1, marker["reason"].strip())
        elif line.strip() and pending:
            stray.append(f"{page.relative_to(REPO)}:{pending[0]}")
            pending = None
        i += 1
    if pending:
        stray.append(f"{page.relative_to(REPO)}:{pending[0]}")
    return blocks, stray


def shell_commands(code: str) -> list[list[str]] | None:
    """The commands of a shell block as argument lists, or None when some command cannot run here."""
    text = re.sub(r"\\\n", " ", code)  # line continuations
    commands: list[list[str]] = []
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            return None
        current: list[str] = []
        for word in [*words, "&&"]:
            if word != "&&":
                current.append(word)
            elif current:
                commands.append(current)
                current = []
    runnable = all(_cli_args(c) is not None for c in commands)
    return commands if commands and runnable else None


def _cli_args(command: list[str]) -> list[str] | None:
    """The arguments of ``mineru-fast`` that ``command`` runs, or None when it is another program."""
    if any(word in ("|", ";", "&", ">", ">>", "<", "||") for word in command):
        return None
    if command[0] == "mineru-fast":
        return command[1:]
    if command[:3] in (["python", "-m", "mineru_fast"], ["python3", "-m", "mineru_fast"]):
        return command[3:]
    return None


def is_synopsis(block: Block) -> bool:
    return block.language == "text" and block.code.lstrip().startswith("mineru-fast")


def runnable(block: Block) -> bool:
    """Whether the test runs or checks this block when it is not marked."""
    if block.language == "python" or block.language == "json" or is_synopsis(block):
        return True
    return block.language in SHELLS and shell_commands(block.code) is not None


ALL = {page: read_blocks(page) for page in PAGES}


def test_every_block_runs_or_is_marked() -> None:
    problems = []
    for blocks, stray in ALL.values():
        problems += [f"{where}: a docs-test skip marker that precedes no code block" for where in stray]
        for block in blocks:
            if block.skip is None and not runnable(block):
                kind = block.language or "no language"
                problems.append(
                    f"{block.where}: a {kind} block that is not run; make it runnable here (python, mineru-fast "
                    f"commands, a synopsis, json) or mark it: <!-- docs-test: skip (why) -->"
                )
    assert not problems, "\n".join(problems)
    assert sum(len(blocks) for blocks, _ in ALL.values()) > 0


def test_marked_blocks_say_why() -> None:
    short = [b.where for blocks, _ in ALL.values() for b in blocks if b.skip is not None and len(b.skip) < 8]
    assert not short, f"skip markers without a reason: {short}"


def test_readme_links_resolve() -> None:
    """The README's relative links (into docs/) name files that exist; mkdocs build --strict checks
    the site's own links, not the README's."""
    readme = REPO / "README.md"
    targets = re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8"))
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links into the documentation"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


# -- running the examples -----------------------------------------------------------------------


_RAN: set[str] = set()  # shell commands already run in the workspace
# How the pages make the tiny model (README.md, getting-started.md): the workspace runs it first.
MAKE_MODEL = ["synth-model", "models/tiny", "--size", "tiny"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch folder with ``examples/`` and ``models/tiny``, as the examples expect: the model is
    made by the pages' own command, which the pages then need not run again."""
    root = tmp_path_factory.mktemp("docs-examples")
    (root / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        run_cli(MAKE_MODEL, "the workspace")
    _RAN.add(shlex.join(["mineru-fast", *MAKE_MODEL]))
    yield root
    _RAN.clear()


@contextlib.contextmanager
def _cli_process_state() -> Iterator[None]:
    """Undo what the CLI's ``main`` changes in this process: the environment (thread variables,
    ``--no-prepared-cache``), warnings routed into logging, and the root logger's level."""
    root = logging.getLogger()
    level = root.level
    with mock.patch.dict(os.environ):
        try:
            yield
        finally:
            logging.captureWarnings(False)
            root.setLevel(level)


def run_cli(args: list[str], where: str) -> None:
    from mineru_fast.cli.main import main

    with _cli_process_state():
        try:
            status = main(args)
        except SystemExit as exc:  # argparse: a usage error or --help / --version
            status = exc.code if isinstance(exc.code, int) else 2
    assert status == 0, f"{where}: `mineru-fast {shlex.join(args)}` exited {status}"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from mineru_fast.cli.main import build_argparser

    top = build_argparser()
    found = {"": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def check_synopsis(block: Block) -> None:
    """Every option a usage synopsis names is an option of its command."""
    parsers = _parsers()
    commands = re.split(r"\n(?=mineru-fast\b)", block.code.strip())
    problems = []
    for text in commands:
        rest = text[len("mineru-fast") :]
        parts = rest.split(" -- ", 1)  # launch ... -- parse ...
        for part in parts:
            first = (part.split() or [""])[0]
            name = first if first in parsers else ""
            options = {s for a in parsers[name]._actions for s in a.option_strings}
            named = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", part)
            problems += [f"`mineru-fast {name}` has no option {opt}" for opt in named if opt not in options]
    assert not problems, f"{block.where}: " + "; ".join(problems)


def _close_parsers(namespace: dict[str, Any]) -> None:
    from mineru_fast.pipeline.parser import DocumentParser

    for value in namespace.values():
        if isinstance(value, DocumentParser):
            value.close()


def _to_run(page: Path) -> list[Block]:
    return [b for b in ALL[page][0] if b.skip is None and runnable(b)]


@pytest.mark.parametrize("page", [p for p in PAGES if _to_run(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_examples_run(page: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    todo = _to_run(page)
    monkeypatch.chdir(workspace)
    namespace: dict[str, Any] = {"__name__": "__docs_example__"}
    try:
        for block in todo:
            if block.language == "python":
                # padded to its place in the page, so a traceback names the page's own line
                source = "\n" * block.line + block.code
                exec(compile(source, str(block.page.relative_to(REPO)), "exec"), namespace)  # noqa: S102
            elif block.language == "json":
                json.loads(block.code)
            elif is_synopsis(block):
                check_synopsis(block)
            else:
                for command in shell_commands(block.code) or []:
                    key = shlex.join(command)
                    if key not in _RAN:
                        run_cli(_cli_args(command) or [], block.where)
                        _RAN.add(key)
    finally:
        _close_parsers(namespace)
