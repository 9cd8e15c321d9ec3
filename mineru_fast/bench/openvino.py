"""OpenVINO GenAI as a peer engine of the side by side: its install, a checkpoint's export, its versions.

A user running a Qwen2-VL model on a CPU with OpenVINO exports the checkpoint with ``optimum-intel``
(``optimum-cli export openvino --task image-text-to-text --weight-format int8|int4``: OpenVINO IR of
the vision encoder, the merger, the text embeddings and the language model, the weights compressed
by NNCF; with ``int4`` the language model's linears get 4-bit groups and the rest stays int8) and
runs it with ``openvino-genai`` (its VLM and continuous-batching pipelines). Nothing in the package
imports this module and the install never depends on OpenVINO: ``ensure_env`` installs what it
needs into a virtual environment of its own, and ``export_checkpoint`` runs the exporter there.

Pins and why (found on 2026-12-05 with the package index's releases): ``openvino-genai``
2026.4.1.0 and ``optimum-intel`` 2.2.0, the newest; optimum-intel 2.2.0 refuses to export Qwen2-VL
with a transformers newer than 5.0 ("Maximum required is 5.0"), so transformers 5.0.0 is pinned
there (mineru-fast's own environment is unaffected); the index's ``torchvision`` is a CUDA build
that breaks transformers' Qwen2-VL imports beside a CPU torch, and the export does not need it, so
it is uninstalled after the install.

    python -m mineru_fast.bench.openvino export CHECKPOINT --weight-format int8 [--out DIR] [--env DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mineru_fast.bench.tool_env import ensure_venv, run_step
from mineru_fast.errors import MineruFastError

OPENVINO_GENAI = "2026.4.1.0"
OPTIMUM_INTEL = "2.2.0"
TRANSFORMERS = "5.0.0"  # optimum-intel 2.2.0's newest allowed for a Qwen2-VL export
WEIGHT_FORMATS = ("int8", "int4")  # optimum-cli's weight-only formats, each a row of the side by side
IR_FILES = (  # what optimum-intel writes for a Qwen2-VL checkpoint (each with its .bin)
    "openvino_language_model.xml",
    "openvino_text_embeddings_model.xml",
    "openvino_vision_embeddings_model.xml",
    "openvino_vision_embeddings_merger_model.xml",
    "openvino_tokenizer.xml",
    "openvino_detokenizer.xml",
)
_VERSIONS_PROBE = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({n: m.version(n) for n in ('openvino', 'openvino-genai', 'optimum-intel', 'nncf', "
    "'transformers', 'torch')}))"
)


class OpenVinoUnavailable(MineruFastError):
    """OpenVINO GenAI cannot be installed or run here, or the export failed; the message says which
    step failed and why."""

    code = "openvino_unavailable"


@dataclass(frozen=True)
class Env:
    """An installed OpenVINO environment.

    Attributes:
        root: the folder holding it (the virtual environment is ``root/venv``).
        python: that environment's interpreter (it runs the exporter and the server).
        versions: ``{"openvino", "openvino-genai", "optimum-intel", "nncf", "transformers", "torch"}``.
    """

    root: Path
    python: Path
    versions: dict[str, str]


def default_root() -> Path:
    """Where ``ensure_env`` installs by default: ``<package cache>/openvino`` (``hub.cache_dir``)."""
    from mineru_fast.runtime.hub import cache_dir

    return cache_dir() / "openvino"


def _run(argv: list[str], step: str) -> subprocess.CompletedProcess:
    """``tool_env.run_step`` raising ``OpenVinoUnavailable``."""
    return run_step(argv, step, OpenVinoUnavailable)


def install_requirements(torch_version: str) -> list[str]:
    """The ``pip install`` arguments of the environment: the pins above, ``nncf`` (the weight
    compression), and ``torch==torch_version`` (the exporter traces the model with it)."""
    return [
        f"openvino-genai=={OPENVINO_GENAI}",
        f"optimum-intel=={OPTIMUM_INTEL}",
        "nncf",
        f"transformers=={TRANSFORMERS}",
        f"torch=={torch_version}",
        "pillow",
        "numpy",
    ]


def ensure_env(root: Path | None = None, log=print) -> Env:
    """Install (once) OpenVINO GenAI and its exporter into ``root/venv``.

    Steps, each skipped when done: the virtual environment (this interpreter's ``venv``), ``pip
    install`` of ``install_requirements`` (torch at this interpreter's version), ``pip uninstall
    torchvision``. ``log`` is told each step that installs something.

    Raises:
        OpenVinoUnavailable: a step failed (pip's last line in the message).
    """
    import torch

    root, venv, python = ensure_venv(
        root or default_root(), "OpenVINO GenAI", OpenVinoUnavailable, lambda line: log(f"[openvino] {line}")
    )
    found = subprocess.run([str(python), "-c", _VERSIONS_PROBE], capture_output=True, text=True)
    versions = json.loads(found.stdout) if found.returncode == 0 else {}
    wanted = {"openvino-genai": OPENVINO_GENAI, "optimum-intel": OPTIMUM_INTEL, "transformers": TRANSFORMERS}
    if any(versions.get(name) != version for name, version in wanted.items()):
        torch_version = torch.__version__.split("+")[0]
        log(f"[openvino] installing openvino-genai {OPENVINO_GENAI}, optimum-intel {OPTIMUM_INTEL} into {venv}")
        _run([str(python), "-m", "pip", "install", "--quiet", *install_requirements(torch_version)],
             "pip install openvino-genai and optimum-intel")  # fmt: skip
        _run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "torchvision"], "pip uninstall torchvision")
        versions = json.loads(_run([str(python), "-c", _VERSIONS_PROBE], "reading OpenVINO's versions").stdout)
    return Env(root, python, versions)


def _export_stamp(checkpoint: Path, weight_format: str, env: Env) -> str:
    """A key of the checkpoint's files (names, sizes, modification times), the weight format and
    the exporter's versions."""
    parts = [weight_format, json.dumps(env.versions, sort_keys=True)]
    for path in sorted(checkpoint.iterdir()):
        if path.is_file():
            stat = path.stat()
            parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def export_checkpoint(checkpoint: Path, out_dir: Path, env: Env, weight_format: str, log=print) -> Path:
    """The checkpoint as OpenVINO IR, exported as its users export it; returns ``out_dir``.

    Runs ``optimum-cli export openvino --model CHECKPOINT --task image-text-to-text --weight-format
    WEIGHT_FORMAT OUT_DIR`` in ``env``. A folder already exported from the same checkpoint files
    with the same format and versions (``out_dir/stamp.json``) is reused.

    Raises:
        ValueError: ``weight_format`` is not one of ``WEIGHT_FORMATS``.
        OpenVinoUnavailable: the export failed or left an IR file missing (``IR_FILES``).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format {weight_format!r}: choose one of {WEIGHT_FORMATS}")
    stamp = _export_stamp(checkpoint, weight_format, env)
    stamp_file = out_dir / "stamp.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()).get("stamp") == stamp:
        return out_dir
    log(f"[openvino] exporting {checkpoint.name} with optimum-intel, {weight_format} weights, into {out_dir}")
    cli = env.python.parent / "optimum-cli"
    argv = [str(cli), "export", "openvino", "--model", str(checkpoint), "--task", "image-text-to-text"]
    _run([*argv, "--weight-format", weight_format, str(out_dir)], f"optimum-cli export openvino ({weight_format})")
    missing = [name for name in IR_FILES if not (out_dir / name).is_file()]
    if missing:
        raise OpenVinoUnavailable(f"optimum-cli export openvino ({weight_format}) wrote no {', '.join(missing)}")
    stamp_file.write_text(json.dumps({"stamp": stamp, "weight_format": weight_format, "versions": env.versions}))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a Qwen2-VL checkpoint to OpenVINO IR as its users do.")
    sub = p.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="install OpenVINO's environment (once) and export CHECKPOINT")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="int8")
    export.add_argument("--out", type=Path, help="IR folder (default: <env>/ir/<checkpoint name>-<format>)")
    export.add_argument("--env", type=Path, help="OpenVINO's environment folder (default: <cache>/openvino)")
    args = p.parse_args(argv)
    try:
        env = ensure_env(args.env)
        out = args.out or env.root / "ir" / f"{args.checkpoint.name}-{args.weight_format}"
        print(export_checkpoint(args.checkpoint, out, env, args.weight_format))
    except OpenVinoUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
