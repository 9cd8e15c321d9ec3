"""``LayoutDetector``: PP-DocLayoutV2 weights found, loaded and run over a window of pages.

Weights are taken from whichever form the user has, MinerU 4's two model repositories or
PaddlePaddle's transformers checkpoint:

- ``opendatalab/MinerU-4_models_onnx``: ``Layout/PP-DocLayoutV2/inference.onnx`` (ONNX Runtime;
  what MinerU 4 runs on CPU),
- ``opendatalab/MinerU-4_models_torch``: ``Layout/PP-DocLayoutV2/`` (transformers checkpoint),
- ``PaddlePaddle/PP-DocLayoutV2_safetensors`` (transformers checkpoint),

as a local path (an ``.onnx`` file, a checkpoint directory, or a snapshot of one of those
repositories) or a hub id, looked up in huggingface_hub's cache first and downloaded only when
allowed. Nothing found is a ``LayoutModelMissing`` error that names the files and the places
searched; there is no silent fallback to another tier.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mineru_fast.errors import LayoutModelMissing, TraceError
from mineru_fast.layout.inference import OnnxRunner, TorchRunner, pixel_values
from mineru_fast.layout.postprocess import Detection, PageLayout, postprocess, scale_box, select_rows, to_page_layout
from mineru_fast.runtime.hub import synthetic_identity

logger = logging.getLogger(__name__)

__all__ = ["LayoutDetector", "LayoutWeights", "resolve_layout_weights", "HUB_SOURCES", "BACKENDS"]

BACKENDS = ("auto", "onnx", "torch")
_ONNX_FILE = "inference.onnx"
_REPO_FOLDER = "Layout/PP-DocLayoutV2"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class HubSource:
    """Where a hub repository keeps PP-DocLayoutV2: ``folder`` inside ``repo`` ("" = the root)."""

    repo: str
    folder: str
    backend: str


HUB_SOURCES: tuple[HubSource, ...] = (
    HubSource("opendatalab/MinerU-4_models_onnx", _REPO_FOLDER, "onnx"),
    HubSource("opendatalab/MinerU-4_models_torch", _REPO_FOLDER, "torch"),
    HubSource("PaddlePaddle/PP-DocLayoutV2_safetensors", "", "torch"),
)

_DOWNLOAD_HINT = (
    f"download {_REPO_FOLDER}/{_ONNX_FILE} of opendatalab/MinerU-4_models_onnx on a connected machine "
    f"with `hf download opendatalab/MinerU-4_models_onnx --include '{_REPO_FOLDER}/*'` (ONNX, what "
    "MinerU 4 runs on CPU; needs onnxruntime) or "
    "`hf download PaddlePaddle/PP-DocLayoutV2_safetensors` (transformers), copy the Hugging Face cache "
    "(HF_HOME) here or pass the downloaded folder or .onnx file as the layout model"
)


@dataclass(frozen=True)
class LayoutWeights:
    """A located model: ``path`` is an ``.onnx`` file (backend ``onnx``) or a checkpoint directory."""

    backend: str
    path: Path


def _is_checkpoint(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file() or not any(folder.glob("*.safetensors")):
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "pp_doclayout_v2"
    except (OSError, ValueError):
        return False


def _in_folder(folder: Path) -> dict[str, Path]:
    """The forms of the model present in a local folder (or a snapshot of a MinerU repository)."""
    found: dict[str, Path] = {}
    for base in (folder, folder / _REPO_FOLDER):
        if "onnx" not in found and (base / _ONNX_FILE).is_file():
            found["onnx"] = base / _ONNX_FILE
        if "torch" not in found and _is_checkpoint(base):
            found["torch"] = base
    return found


def _choose(found: dict[str, Path], backend: str) -> LayoutWeights | None:
    order = {"onnx": ["onnx"], "torch": ["torch"]}.get(backend)
    if order is None:  # auto: ONNX when onnxruntime is there (MinerU 4's CPU choice), else transformers
        order = ["onnx", "torch"] if importlib.util.find_spec("onnxruntime") else ["torch", "onnx"]
    for name in order:
        if name in found:
            return LayoutWeights(name, found[name])
    return None


def _from_hub(source: HubSource, download: bool) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = [f"{source.folder}/*"] if source.folder else ["*.json", "*.safetensors"]
    for local_only in (True, False) if download else (True,):
        try:
            return Path(snapshot_download(source.repo, allow_patterns=patterns, local_files_only=local_only))
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            logger.debug("%s not available (local_only=%s): %s", source.repo, local_only, exc)
    return None


def resolve_layout_weights(
    source: str | Path | None = None, backend: str = "auto", download: bool = True
) -> LayoutWeights:
    """Find PP-DocLayoutV2 on this machine (or download it when allowed).

    Args:
        source: an ``.onnx`` file, a local folder (checkpoint, or snapshot of a MinerU model
            repository), a hub id, or None for ``HUB_SOURCES`` in order.
        backend: ``"onnx"``, ``"torch"`` or ``"auto"`` (ONNX when onnxruntime is installed).
        download: fetch from the hub when the local cache lacks the files (also off when
            ``HF_HUB_OFFLINE=1``).

    Returns:
        The located weights.

    Raises:
        ValueError: unknown ``backend``.
        LayoutModelMissing: nothing usable found; the message lists where it looked and what to
            download.
    """
    from huggingface_hub import constants

    if backend not in BACKENDS:
        raise ValueError(f"layout backend must be one of {BACKENDS}, got {backend!r}")
    download = download and not constants.HF_HUB_OFFLINE
    wanted = "" if backend == "auto" else f" ({backend})"
    if source is not None:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".onnx" and backend in ("auto", "onnx"):
            return LayoutWeights("onnx", path)
        if path.is_dir():
            found = _choose(_in_folder(path), backend)
            if found is None:
                raise LayoutModelMissing(
                    f"{path} holds no PP-DocLayoutV2{wanted} (looked for {_ONNX_FILE} and a transformers "
                    f"checkpoint, also under {_REPO_FOLDER}/); {_DOWNLOAD_HINT}"
                )
            return found
        if not _HUB_ID_RE.match(str(source)):
            raise LayoutModelMissing(f"no such layout model file or folder: {path}; {_DOWNLOAD_HINT}")
        hub = [s for s in HUB_SOURCES if s.repo == str(source)] or [HubSource(str(source), "", "torch")]
    else:
        hub = list(HUB_SOURCES)
    looked = []
    for candidate in hub:
        if backend != "auto" and candidate.backend != backend:
            continue
        looked.append(f"{candidate.repo}/{candidate.folder}".rstrip("/"))
        snapshot = _from_hub(candidate, download)
        found = _choose(_in_folder(snapshot), backend) if snapshot is not None else None
        if found is not None:
            return found
    raise LayoutModelMissing(
        f"PP-DocLayoutV2{wanted} is needed for tier='standard' and was not found: looked for "
        f"{', '.join(looked) or 'nothing matching the backend'} in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}){' and on the hub' if download else ''}; {_DOWNLOAD_HINT}"
    )


class LayoutDetector:
    """PP-DocLayoutV2 with MinerU 4's post-processing, batched over a window of pages.

    Use ``LayoutDetector.from_pretrained``. ``detect`` is synchronous and thread-compatible (one
    call at a time per detector).

    Attributes:
        weights: what was loaded.
        rules: post-processing rule set, MinerU's for the backend (``"onnx"`` or ``"torch"``).
        batch_size: pages per forward pass.
    """

    def __init__(self, runner: OnnxRunner | TorchRunner, weights: LayoutWeights, batch_size: int = 4) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.runner = runner
        self.weights = weights
        self.rules = weights.backend
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(
        cls,
        source: str | Path | None = None,
        *,
        backend: str = "auto",
        threads: int | None = None,
        batch_size: int = 4,
        download: bool = True,
    ) -> LayoutDetector:
        """Locate (``resolve_layout_weights``) and load PP-DocLayoutV2.

        Args:
            source / backend / download: see ``resolve_layout_weights``.
            threads: ONNX Runtime intra-op threads (default: the process's thread plan); the
                transformers backend uses torch's process-wide setting.
            batch_size: pages per forward pass.

        Raises:
            LayoutModelMissing: no weights found. ModelLoadError: found but not loadable
                (e.g. onnxruntime missing for an ONNX file, or a foreign graph).
        """
        weights = resolve_layout_weights(source, backend, download)
        if weights.backend == "onnx":
            from mineru_fast.runtime.cpu import read_topology
            from mineru_fast.runtime.threads import plan_threads

            intra_op = plan_threads(read_topology(), threads, bind=False).intra_op
            runner: OnnxRunner | TorchRunner = OnnxRunner(weights.path, intra_op)
        else:
            runner = TorchRunner(weights.path)
        logger.info("layout model: PP-DocLayoutV2 (%s) from %s", weights.backend, weights.path)
        return cls(runner, weights, batch_size)

    def identity(self) -> str:
        """How reports name the model: ``"PP-DocLayoutV2 onnx <path>"``, marked when synthetic."""
        folder = self.weights.path.parent if self.weights.path.is_file() else self.weights.path
        synthetic = synthetic_identity(folder)
        return f"PP-DocLayoutV2 {self.weights.backend} {self.weights.path}" + (f" [{synthetic}]" if synthetic else "")

    def detect(
        self, images: Sequence[Image.Image], replay: Sequence[Sequence[Detection]] | None = None
    ) -> list[PageLayout]:
        """Layouts of a window of pages.

        Args:
            images: page images (RGB, any size), in page order.
            replay: per page, detections with boxes normalized to the page (a ``LayoutTrace``'s
                pages) to use instead of the model's; the model still runs on every page.

        Returns:
            One ``PageLayout`` per image.

        Raises:
            TraceError: ``replay`` does not have one entry per image.
            ModelLoadError: the model's outputs are malformed.
        """
        if replay is not None and len(replay) != len(images):
            raise TraceError(f"layout replay has {len(replay)} pages for {len(images)} images")
        layouts: list[PageLayout] = []
        for start in range(0, len(images), self.batch_size):
            chunk = list(images[start : start + self.batch_size])
            sizes = [image.size for image in chunk]
            rows = self.runner.run(pixel_values(chunk), sizes)
            for offset, (page_rows, (width, height)) in enumerate(zip(rows, sizes, strict=True)):
                if replay is None:
                    detections = select_rows(page_rows)
                else:
                    page = replay[start + offset]
                    detections = [Detection(d.label, d.score, scale_box(d.bbox, width, height)) for d in page]
                regions = postprocess(detections, (width, height), self.rules)
                layouts.append(to_page_layout(regions, (width, height), detections))
        return layouts
