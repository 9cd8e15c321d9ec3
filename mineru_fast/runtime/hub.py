"""Where models and cached files come from.

``--model DIR|ID`` becomes a local checkpoint directory: a directory is used as is, a Hugging Face
hub id (``org/name``) is found in huggingface_hub's cache or downloaded, following the hub's
conventions (``revision``, ``cache_dir``, ``token``, ``local_files_only`` / ``HF_HUB_OFFLINE``).
The package's own cache (synthetic models, traces built for benchmarks) is ``cache_dir()``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mineru_fast.errors import ModelLoadError, ModelNotCached

__all__ = [
    "DEFAULT_MODEL_ID",
    "MODEL_IDS",
    "CACHE_ENV",
    "ModelInfo",
    "cache_dir",
    "resolve_model",
    "resolve_model_info",
    "MARKER",
    "LM_SOURCE",
    "lm_source",
    "synthetic_identity",
    "match_file_mode",
]

# Hub ids of the MinerU2.5 versions (protocol.MODEL_VERSIONS); the default is the one model of
# mineru 4.0.12's registry (mineru/model/registry.py: "opendatalab/MinerU2.5-Pro-2605-1.2B").
MODEL_IDS = {"pro-2605": "opendatalab/MinerU2.5-Pro-2605-1.2B", "2509": "opendatalab/MinerU2.5-2509-1.2B"}
DEFAULT_MODEL_ID = MODEL_IDS["pro-2605"]
CACHE_ENV = "MINERU_FAST_CACHE"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]
# huggingface_hub's spelling of a true environment flag (constants.ENV_VARS_TRUE_VALUES).
# Synthetic model directories (engine.synthetic, layout.synthetic): a marker file written last,
# and the provenance of a trained language model put into one (make_synthetic_model's lm_gguf).
MARKER = "SYNTHETIC.md"
LM_SOURCE = "LM_SOURCE.json"
_TRUE = {"1", "ON", "YES", "TRUE"}


# "0", "off", "false" or "no": the prepared-model cache is off; a folder: where its entries are
PREPARED_CACHE_ENV = "MINERU_FAST_PREPARED_CACHE"


def prepared_cache_root(enabled: bool | None = None) -> Path | None:
    """The folder of the fast engine's prepared-model entries (``engine.prepared``), or None for
    no cache.

    ``enabled`` False: None. Otherwise ``$MINERU_FAST_PREPARED_CACHE`` decides when set (``0``,
    ``off``, ``false`` or ``no``: None, unless ``enabled`` is True; else it is the folder), and by
    default it is ``cache_dir() / "prepared"``.
    """
    if enabled is False:
        return None
    value = os.environ.get(PREPARED_CACHE_ENV, "").strip()
    default = cache_dir() / "prepared"
    if value.lower() in ("0", "off", "false", "no"):
        return default if enabled else None
    return Path(value).expanduser() if value else default


def cache_dir() -> Path:
    """The package's own cache directory (not the Hugging Face cache, which huggingface_hub keeps).

    ``$MINERU_FAST_CACHE`` when set, else ``$XDG_CACHE_HOME/mineru-fast``, else
    ``~/.cache/mineru-fast``. Holds the synthetic models made on demand (``synthetic-<size>-seed<n>``)
    and the replay traces built for benchmark workloads (``traces/<workload>``). Not created here.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mineru-fast"


@dataclass(frozen=True)
class ModelInfo:
    """Which checkpoint a parser runs (``DocumentParser.model_info``).

    Attributes:
        local_dir: the directory the checkpoint was read from.
        model_id: hub id (``org/name``) for a model from a Hugging Face cache (also when its snapshot
            directory was passed as a path); None for any other directory.
        revision: the revision asked for (branch, tag or commit); None = the default branch.
        commit: the 40-hex commit of the snapshot when it came from a hub cache, else None.
    """

    local_dir: Path
    model_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelInfo:
        """Describe a model directory given by path; a snapshot of a hub cache
        (``.../models--org--name/snapshots/<40-hex commit>``) yields its ``model_id`` and ``commit``."""
        path = Path(path).absolute()
        repo = path.parent.parent.name
        if path.parent.name == "snapshots" and repo.startswith("models--") and _COMMIT_RE.match(path.name):
            # Hub ids cannot contain "--", so the folder name maps back unambiguously.
            return cls(path, repo[len("models--") :].replace("--", "/"), commit=path.name)
        return cls(path)

    def to_dict(self) -> dict[str, str | None]:
        """JSON-ready form: ``{"model_id", "revision", "commit", "local_dir"}``."""
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "commit": self.commit,
            "local_dir": str(self.local_dir),
        }


def _missing_files(path: Path) -> str | None:
    """What keeps ``path`` from being a model directory, or None."""
    if not (path / "config.json").is_file():
        return f"{path} is not a model directory (no config.json)"
    if not any(path.glob("*.safetensors")):
        return f"{path} has no *.safetensors weights"
    return None


def _offline(local_files_only: bool | None) -> bool:
    """``local_files_only``, or huggingface_hub's offline mode (read now as well as at its import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE
    return bool(local_files_only) or constants.HF_HUB_OFFLINE or env


def _hub_root(cache: str | Path | None) -> Path:
    from huggingface_hub import constants

    return Path(cache or constants.HF_HUB_CACHE).expanduser()


def _what_is_missing(model_id: str, revision: str | None, cache: str | Path | None) -> str:
    """Which part of the hub cache layout is absent for ``model_id`` at ``revision``."""
    root = _hub_root(cache)
    repo = root / ("models--" + model_id.replace("/", "--"))
    if not repo.is_dir():
        return f"no {repo.name} folder in {root}"
    ref = revision or "main"
    if _COMMIT_RE.match(ref):
        commit = ref
    elif (repo / "refs" / ref).is_file():
        commit = (repo / "refs" / ref).read_text()  # as huggingface_hub reads it (no strip)
    else:
        known = sorted(p.relative_to(repo / "refs").as_posix() for p in (repo / "refs").rglob("*") if p.is_file())
        return f"no ref {ref!r} in {repo / 'refs'} (cached refs: {', '.join(known) or 'none'})"
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        return f"no snapshot {commit} in {repo / 'snapshots'} (revision {ref!r})"
    return _missing_files(snapshot) or f"{snapshot} is incomplete"


def resolve_model_info(
    path_or_id: str | Path = DEFAULT_MODEL_ID,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
) -> ModelInfo:
    """Find the checkpoint ``path_or_id`` names, downloading it when allowed.

    An existing directory is used as is. A version name of ``MODEL_IDS`` (``"2509"``,
    ``"pro-2605"``) stands for its hub id when no directory of that name exists. A hub id is looked
    up in the local Hugging Face cache first (a cached ``revision`` is used without asking the hub
    whether the branch moved; pass a commit hash to pin one), then downloaded (``*.json``,
    ``*.safetensors``, tokenizer and template files) unless offline.

    Args:
        path_or_id: model directory, hub id such as ``opendatalab/MinerU2.5-Pro-2605-1.2B`` (the
            default), or a version name of ``MODEL_IDS``.
        revision: branch, tag or commit hash of a hub id; None = the default branch (``main``).
        cache_dir: Hugging Face hub cache; None = huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME``).
        token: hub token for private or gated models; None = huggingface_hub's (``HF_TOKEN`` or
            the stored login).
        local_files_only: never download. None (default) follows ``HF_HUB_OFFLINE``.

    Returns:
        The ``ModelInfo``: local directory, hub id, revision and snapshot commit.

    Raises:
        ModelNotCached: offline and the model (or that revision, or some of its files) is not in the
            cache; the message says what is missing and where it was looked for.
        ModelLoadError: not a model directory, not a valid id, ``revision`` given with a directory,
            or the download failed (the message says how to get the files onto the machine).
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ModelLoadError(f"revision {revision!r} selects a hub snapshot; {path} is a local directory")
        problem = _missing_files(path)
        if problem:
            raise ModelLoadError(problem)
        return ModelInfo.from_dir(path)
    model_id = MODEL_IDS.get(str(path_or_id), str(path_or_id))
    if not _HUB_ID_RE.match(model_id):
        raise ModelLoadError(f"no such model directory: {model_id}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = Path(
            snapshot_download(
                model_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=_CHECKPOINT_FILES,
                local_files_only=True,
            )
        )
        if _missing_files(local) is None:
            return ModelInfo(local, model_id, revision, local.name)
    except LocalEntryNotFoundError:
        pass
    label = model_id + (f" (revision {revision})" if revision else "")
    if _offline(local_files_only):
        missing = _what_is_missing(model_id, revision, cache_dir)
        command = f"hf download {model_id}" + (f" --revision {revision}" if revision else "")
        raise ModelNotCached(
            f"model {label} is not in the local Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1, "
            f"--offline or local_files_only=True): {missing}. On a connected machine run `{command}` and copy "
            "the cache here, or copy the model directory and pass its path."
        )
    local = _download(model_id, label, revision, cache_dir, token)
    return ModelInfo(local, model_id, revision, local.name)


def _download(
    model_id: str, label: str, revision: str | None, cache_dir: str | Path | None, token: str | bool | None
) -> Path:
    """``snapshot_download`` with its errors turned into ``ModelLoadError``s that say what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        local = Path(
            snapshot_download(
                model_id, revision=revision, cache_dir=cache_dir, allow_patterns=_CHECKPOINT_FILES, token=token
            )
        )
    except RevisionNotFoundError as exc:
        raise ModelLoadError(f"model {model_id!r} has no revision {revision!r} on the hub") from exc
    except RepositoryNotFoundError as exc:  # also gated repositories without access
        raise ModelLoadError(
            f"model {model_id!r} is not on the hub or needs access: pass a token (--token, HF_TOKEN or "
            f"`hf auth login`) of an account that may read it ({type(exc).__name__})"
        ) from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model {label} is not in the local Hugging Face cache and cannot be downloaded here "
            f"({type(exc).__name__}). On a connected machine run `hf download {model_id}` and copy "
            "the cache (HF_HOME) here, or copy the model directory and pass its path with --model DIR."
        ) from exc
    problem = _missing_files(local)
    if problem:
        raise ModelLoadError(f"model {label}: {problem}")
    return local


def resolve_model(
    path_or_id: str | Path = DEFAULT_MODEL_ID,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """The local checkpoint directory of ``path_or_id``: ``resolve_model_info(...).local_dir``.

    Arguments and errors are ``resolve_model_info``'s.
    """
    return resolve_model_info(
        path_or_id, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only
    ).local_dir


def match_file_mode(paths: list[Path], like: Path) -> None:
    """Give ``paths`` the permission bits of ``like``, a file this process wrote with ``open``.

    safetensors (0.8) writes a checkpoint through a private temporary file, so the weights come out
    ``0600`` whatever the umask while the folder's other files get the umask's mode; a model folder
    made by one user then fails to load for another (a container's user reading a mounted folder).
    """
    mode = like.stat().st_mode & 0o777
    for path in paths:
        path.chmod(mode)


def lm_source(model_dir: str | Path) -> dict | None:
    """The provenance of a trained language model ````engine.synthetic.make_synthetic_model(..., lm_gguf=...)```` put
    into ``model_dir`` (``LM_SOURCE.json``: ``gguf_file``, ``gguf_name``, ``size_bytes``,
    ``sha256``, ``tensor_types``, ``head``), None for any other model directory."""
    path = Path(model_dir) / LM_SOURCE
    if not (Path(model_dir) / MARKER).is_file() or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def synthetic_identity(model_dir: str | Path) -> str | None:
    """``"synthetic (random weights, size=full, seed=0, version=pro-2605)"`` for a synthetic model
    directory (read from its ``SYNTHETIC.md``; older ones name no version; ``"synthetic vision (...) +
    trained LM '<name>' from <file>"`` with a GGUF language model), None for any other model
    directory."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    found = re.search(r"size=\w+, seed=\d+(?:, version=[\w-]+)?", marker.read_text(encoding="utf-8"))
    source = lm_source(model_dir)
    if source is not None:
        where = f", {found.group(0)}" if found else ""
        return f"synthetic vision (random weights{where}) + trained LM {source['gguf_name']!r} ({source['gguf_file']})"
    return f"synthetic (random weights, {found.group(0)})" if found else "synthetic (random weights)"
