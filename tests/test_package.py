"""Tier 1: the package as installed: entry points, version, type marker, import structure."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import resources
from pathlib import Path

import pytest

import mineru_fast

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return proc.stdout.strip()


def test_python_dash_m_and_one_version():
    proc = subprocess.run([sys.executable, "-m", "mineru_fast", "--version"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == f"mineru-fast {mineru_fast.__version__}"
    assert importlib.metadata.version("mineru-fast") == mineru_fast.__version__  # pyproject reads __version__
    usage = subprocess.run([sys.executable, "-m", "mineru_fast"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "usage: mineru-fast" in usage.stderr


def test_typed_marker_and_lazy_imports():
    assert (resources.files("mineru_fast") / "py.typed").is_file()
    assert (resources.files("mineru_fast") / "schema" / "document.schema.json").is_file()  # package data
    # Parsing needs neither httpx nor torch at import; the launcher does not import the CLI.
    loaded = run_python(
        "import sys, mineru_fast, mineru_fast.cli.launch; "
        "print(sorted(m for m in ('httpx', 'torch', 'mineru_fast.cli.main') if m in sys.modules))"
    )
    assert loaded == "[]"
    assert run_python("import mineru_fast; print(mineru_fast.Client.__module__, mineru_fast.AsyncClient.__name__)") == (
        "mineru_fast.client AsyncClient"
    )


def test_every_command_line_argument_has_help():
    """``trace``'s flags (and a few others) showed in ``--help`` with no description."""
    import argparse

    from mineru_fast.cli.main import build_argparser

    commands = next(a for a in build_argparser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [
        f"{name} {' '.join(action.option_strings) or action.dest}"
        for name, command in commands.items()
        for action in command._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert missing == []
    assert set(commands) == {"parse", "prepare", "synth-model", "bench", "trace", "serve", "launch", "batch", "info"}


def test_library_warnings_go_through_logging_not_bare_stderr_lines():
    """A library's warning came out as a bare ``file:line: UserWarning: ...`` line on stderr."""
    code = (
        "import sys, warnings; import mineru_fast.cli.info as info; from mineru_fast.cli.main import main; "
        "info.collect = lambda: warnings.warn('a library notice', UserWarning) or {}; "
        "info.render = lambda collected: ''; sys.exit(main(sys.argv[1:]))"
    )
    quiet, verbose = (
        subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        for argv in (["info"], ["-v", "info"])
    )
    assert (quiet.returncode, quiet.stderr) == (0, "")  # a warning is logged, shown with -v
    assert verbose.returncode == 0 and verbose.stderr.startswith("WARNING py.warnings: ")
    assert "a library notice" in verbose.stderr


def test_ci_keeps_its_own_environments_and_the_quick_start_installs_for_users():
    """``.ci/run`` began with ``rm -rf .venv``, deleting the environment the Quick start had just
    made; the Quick start showed only the 1.5 GB development install. (The README's Install section
    and the site's Getting started page are the Quick start now.)"""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    ci = (repo / ".ci" / "run").read_text()
    made = re.findall(r"(?:rm -rf|-m venv) (\S+)", ci)
    assert made and all(folder.startswith(".venv-") for folder in made), made
    install = (repo / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    getting_started = (repo / "docs" / "getting-started.md").read_text()
    assert "pip install .\n" in install and "pip install .\n" in getting_started
    assert "MINERU_FAST_SHARED" in getting_started


@pytest.mark.slow
def test_wheel_and_sdist_carry_the_licence_and_notice(tmp_path):
    """LICENSE (Apache-2.0) and NOTICE (MinerU, mineru-vl-utils, DocVortex) travel in both
    distributions, built from the tracked files as a clean clone holds them."""
    pytest.importorskip("setuptools", reason="setuptools builds the distributions")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    source = tmp_path / "src"
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    out = tmp_path / "dist"
    out.mkdir()
    names = []
    for hook in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state between hooks
        code = f"import sys; from setuptools import build_meta as b; print('built:', b.{hook}(sys.argv[1]))"
        proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                              timeout=300, check=True)  # fmt: skip
        names.append(proc.stdout.rsplit("built: ", 1)[1].strip())
    wheel_name, sdist_name = names
    with zipfile.ZipFile(out / wheel_name) as wheel:
        names = wheel.namelist()
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert {f"{info}/licenses/LICENSE", f"{info}/licenses/NOTICE"} <= set(names)
    with tarfile.open(out / sdist_name) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"LICENSE", "NOTICE"} <= members
    assert "Apache License" in (REPO / "LICENSE").read_text() and "MinerU" in (REPO / "NOTICE").read_text()
