"""A benchmark's outside tools in a virtual environment of their own: one install step run, the
environment made. Shared by ``bench.llamacpp``, ``bench.openvino`` and ``bench.vllm_cpu``, each
raising its own ``*Unavailable`` error so a benchmark can skip that engine with the reason."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def run_step(argv: list[str], step: str, unavailable: type[Exception], **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv`` (output captured as text; ``kwargs`` go to ``subprocess.run``).

    Raises:
        unavailable: the program cannot start (naming ``step`` and the OS error) or exits non-zero
            (naming ``step`` and its last line of output, stderr first).
    """
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    except OSError as exc:
        raise unavailable(f"{step}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise unavailable(f"{step} failed: {tail[0]}")
    return proc


def ensure_venv(
    root: Path, what: str, unavailable: type[Exception], log: Callable[[str], object]
) -> tuple[Path, Path, Path]:
    """``root`` (made, absolute) and its virtual environment ``root/venv``, created with this
    interpreter's ``venv`` where it has no interpreter yet (``log`` told so, naming ``what``);
    returns ``(root, venv, venv python)``.

    Raises:
        unavailable: ``venv`` failed.
    """
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating a virtual environment for {what} in {venv}")
        run_step([sys.executable, "-m", "venv", str(venv)], f"creating the virtual environment for {what}", unavailable)
    return root, venv, python
