"""Resolve ``--model DIR|ID`` to a local checkpoint directory (huggingface_hub's cache for ids)."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL_ID = "opendatalab/MinerU2.5-2509-1.2B"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]


def _check_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return path


def resolve_model(path_or_id: str | Path = DEFAULT_MODEL_ID) -> Path:
    """A local directory holding the checkpoint.

    A path to an existing directory is used as is. Otherwise a hub id (``org/name``) is looked up
    in huggingface_hub's local cache first, then downloaded unless ``HF_HUB_OFFLINE=1``.

    Raises:
        ModelLoadError: not a model directory, not a valid id, or not cached and not downloadable
            (the message says how to get the files onto the machine).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return _check_dir(path)
    model_id = str(path_or_id)
    if not _HUB_ID_RE.match(model_id):
        raise ModelLoadError(f"no such model directory: {model_id}")
    try:
        return Path(snapshot_download(model_id, allow_patterns=_CHECKPOINT_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(model_id, allow_patterns=_CHECKPOINT_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model {model_id!r} is not in the local Hugging Face cache and cannot be downloaded here "
            f"({type(exc).__name__}). On a connected machine run `hf download {model_id}` and copy "
            "the cache (HF_HOME) here, or copy the model directory and pass its path with --model DIR."
        ) from exc
