"""Running PP-DocLayoutV2: input preparation and the two runtimes (ONNX Runtime, transformers).

Both runtimes return, per page, the rows of the published ONNX graph: a float array ``[N, 8]``
of ``class id, score, x0, y0, x1, y1, order_a, order_b`` with boxes in the page image's pixels,
so one post-processing (``postprocess.select_rows``) serves both.

The published ONNX graph (``opendatalab/MinerU-4_models_onnx``, ``Layout/PP-DocLayoutV2/
inference.onnx``, exported from PaddlePaddle) takes ``image`` ``[B, 3, 800, 800]`` float32 RGB in
0..1, ``scale_factor`` ``[B, 2]`` (800 / height, 800 / width) and ``im_shape`` ``[B, 2]``
(800, 800), and returns the rows of all pages stacked ``[sum N, 8]`` plus the per-page row counts
``[B]`` int32 (MinerU 4.0.12, ``pp_doclayout_v2_onnx.py``). For transformers'
``PPDocLayoutV2ForObjectDetection`` the rows are made here the way the graph makes them: the top
300 of all (query, class) sigmoid scores, boxes scaled to the page, ``order_a`` = the query's rank
in the reading-order head's pairwise vote (MinerU's ``_get_order_seqs``) and ``order_b`` = the
query's best class score.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from mineru_fast.errors import ModelLoadError
from mineru_fast.layout.labels import INPUT_SIZE, LABELS

logger = logging.getLogger(__name__)

__all__ = ["pixel_values", "rows_from_outputs", "OnnxRunner", "TorchRunner", "ROW_COLUMNS"]

ROW_COLUMNS = 8
_ONNX_INPUTS = {"image", "scale_factor", "im_shape"}


def pixel_values(images: Sequence[Image.Image]) -> np.ndarray:
    """Page images -> the detector's input, as MinerU's transformers backend prepares it.

    Each image is converted to RGB, resized to 800x800 with bicubic interpolation (no
    antialiasing, values rounded back to 0..255 as torchvision does on uint8) and scaled by 1/255.

    Args:
        images: page images of any size and mode.

    Returns:
        float32 array ``[B, 3, 800, 800]``.
    """
    import torch

    height, width = INPUT_SIZE
    out = np.empty((len(images), 3, height, width), dtype=np.float32)
    for i, image in enumerate(images):
        rgb = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None].float()
        rgb = rgb.contiguous(memory_format=torch.channels_last)  # same values, ~1.7x faster to resize
        resized = torch.nn.functional.interpolate(rgb, size=(height, width), mode="bicubic", align_corners=False)
        out[i] = (resized[0].round().clamp(0, 255) / 255.0).numpy()
    return out


def rows_from_outputs(logits, pred_boxes, order_logits, page_hw):
    """``PPDocLayoutV2ForObjectDetection`` outputs -> the published graph's rows.

    Args:
        logits: ``[B, Q, C]`` class logits.
        pred_boxes: ``[B, Q, 4]`` boxes as normalized (center x, center y, width, height).
        order_logits: ``[B, Q, Q]`` pairwise reading-order logits.
        page_hw: ``[B, 2]`` float (height, width) of each page image, pixels.

    Returns:
        torch tensor ``[B, Q, 8]``, rows ordered by score (highest first).
    """
    import torch

    batch, queries, classes = logits.shape
    precedes = order_logits.sigmoid()
    votes = precedes.triu(1).sum(1) + (1 - precedes.transpose(1, 2)).tril(-1).sum(1)
    rank = votes.argsort(1).argsort(1).to(logits.dtype)
    scores = logits.sigmoid()
    best = scores.amax(-1)
    top, flat = scores.flatten(1).topk(queries, dim=1)
    label = flat % classes
    query = flat // classes
    center, size = pred_boxes.split(2, -1)
    scale = page_hw.flip(-1).repeat(1, 2)[:, None, :]  # [B, 1, 4] = w, h, w, h
    corners = torch.cat([center - size / 2, center + size / 2], -1) * scale
    corners = corners.gather(1, query[..., None].expand(batch, queries, 4))
    return torch.cat(
        [
            label[..., None].to(logits.dtype),
            top[..., None],
            corners,
            rank.gather(1, query)[..., None],
            best.gather(1, query)[..., None],
        ],
        -1,
    )


def _page_hw(sizes: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.array([[h, w] for w, h in sizes], dtype=np.float32)


class OnnxRunner:
    """The published ONNX graph (or one of the same signature) on ONNX Runtime's CPU provider.

    Args:
        path: the ``.onnx`` file.
        threads: intra-op threads of the session.

    Raises:
        ModelLoadError: onnxruntime is not installed, the file cannot be loaded, or the graph does
            not have PP-DocLayoutV2's signature.
    """

    def __init__(self, path: str | Path, threads: int) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ModelLoadError(
                "the ONNX PP-DocLayoutV2 needs onnxruntime: pip install 'mineru-fast[standard]'"
            ) from exc
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ModelLoadError(f"{path}: onnxruntime cannot load it ({exc})") from exc
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = self.session.get_outputs()
        if "image" not in inputs or not set(inputs) <= _ONNX_INPUTS or len(outputs) != 2:
            raise ModelLoadError(
                f"{path}: not PP-DocLayoutV2's graph (inputs {sorted(inputs)}, {len(outputs)} outputs; "
                "expected image[, scale_factor, im_shape] -> rows, counts)"
            )
        batch = inputs["image"].shape[0]
        self.max_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.input_names = set(inputs)
        self.path = Path(path)

    def run(self, pixels: np.ndarray, sizes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Detector rows of a batch of pages.

        Args:
            pixels: ``pixel_values`` output ``[B, 3, 800, 800]``.
            sizes: ``(width, height)`` of each page image, pixels.

        Returns:
            One float array ``[N_i, 8]`` per page.

        Raises:
            ModelLoadError: the graph's outputs do not have the expected shapes.
        """
        if self.max_batch is None or len(sizes) == self.max_batch:
            return self._run(pixels, sizes)
        out: list[np.ndarray] = []
        step = self.max_batch  # a graph with a fixed batch: full chunks, the last padded by repeats
        for start in range(0, len(sizes), step):
            chunk, chunk_sizes = pixels[start : start + step], list(sizes[start : start + step])
            pad = step - len(chunk_sizes)
            if pad:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
                chunk_sizes += chunk_sizes[-1:] * pad
            out.extend(self._run(chunk, chunk_sizes)[: step - pad])
        return out

    def _run(self, pixels: np.ndarray, sizes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        height, width = INPUT_SIZE
        feed = {"image": pixels}
        if "scale_factor" in self.input_names:
            feed["scale_factor"] = np.array([[height / h, width / w] for w, h in sizes], dtype=np.float32)
        if "im_shape" in self.input_names:
            feed["im_shape"] = np.array([[height, width]] * len(sizes), dtype=np.float32)
        rows, counts = self.session.run(None, feed)
        if rows.ndim != 2 or rows.shape[1] != ROW_COLUMNS or counts.shape != (len(sizes),):
            raise ModelLoadError(f"{self.path}: unexpected outputs {rows.shape} and {counts.shape}")
        if counts.dtype.kind not in "iu" or (counts < 0).any() or int(counts.sum()) != len(rows):
            raise ModelLoadError(f"{self.path}: per-page counts {counts.tolist()} do not add up to {len(rows)} rows")
        return np.split(rows, np.cumsum(counts)[:-1].astype(np.int64))


class TorchRunner:
    """A transformers ``PPDocLayoutV2ForObjectDetection`` checkpoint in float32 on the CPU.

    Torch's thread count is the process's (set once for the whole parser), not set here.

    Args:
        model_dir: directory with ``config.json`` and safetensors weights.

    Raises:
        ModelLoadError: the checkpoint cannot be loaded or its labels are not PP-DocLayoutV2's.
    """

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import PPDocLayoutV2ForObjectDetection

        try:
            self.model = PPDocLayoutV2ForObjectDetection.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"{model_dir}: cannot load the PP-DocLayoutV2 checkpoint ({exc})") from exc
        labels = tuple(self.model.config.id2label[i] for i in range(len(self.model.config.id2label)))
        if labels != LABELS:
            raise ModelLoadError(f"{model_dir}: its labels {labels} are not PP-DocLayoutV2's 25 classes")

    def run(self, pixels: np.ndarray, sizes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Detector rows of a batch of pages (same contract as ``OnnxRunner.run``)."""
        import torch

        with torch.inference_mode():
            out = self.model(pixel_values=torch.from_numpy(pixels))
            rows = rows_from_outputs(out.logits, out.pred_boxes, out.order_logits, torch.from_numpy(_page_hw(sizes)))
        return [page.numpy() for page in rows]
