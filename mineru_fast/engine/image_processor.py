"""Qwen2-VL's image preprocessing, read from a checkpoint's ``preprocessor_config.json``.

The steps and their order are those of transformers' ``Qwen2VLImageProcessorPil`` (transformers
5.x, the class ``AutoImageProcessor`` picks for MinerU2.5 where torchvision is absent), so the
pixels are bitwise the ones it gives (``tests/test_preprocess.py`` compares them):

1. ``smart_resize``: height and width rounded to multiples of ``patch_size * merge_size`` (28 px),
   scaled down (floor) when the area is over ``max_pixels`` and up (ceil) when under
   ``min_pixels``, the aspect ratio kept; an edge ratio above 200 is refused;
2. the RGB image resized with Pillow (``resample``, bicubic for MinerU2.5), uint8;
3. ``x * rescale_factor`` in float64, cast to float32; ``(x - mean) / std`` in float32 per channel;
4. 14 px patches in 2x2 merge-window order, each repeated ``temporal_patch_size`` (2) times.

Importing transformers' image-processing modules costs about 2 s and 110 MB at every start-up,
which is why the engine does these few steps itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mineru_fast.errors import ModelLoadError
from mineru_fast.inputs.documents import to_rgb

# Image processor types whose preprocessing this module reproduces (the Pil, fast and slow
# classes of transformers share the steps above).
SUPPORTED_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
MAX_EDGE_RATIO = 200  # Qwen2-VL's smart_resize refuses a longer-to-shorter edge ratio above this


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size ``(height, width)`` in pixels, both multiples of ``factor``.

    Raises:
        ValueError: the edge ratio is above ``MAX_EDGE_RATIO``.
    """
    if max(height, width) / min(height, width) > MAX_EDGE_RATIO:
        raise ValueError(
            f"the image's edge ratio must be at most {MAX_EDGE_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen2-VL image preprocessing with a checkpoint's settings.

    Attributes:
        min_pixels / max_pixels: area bounds of the resized image in pixels (``size``'s
            ``shortest_edge`` / ``longest_edge``; 3136 and 1,605,632 = 2048 * 28 * 28 for MinerU2.5).
        patch_size: ViT patch edge in pixels (14); merge_size: patches merged per side (2);
        temporal_patch_size: frames per patch (2; a still image is repeated).
        mean / std: per-channel normalization (CLIP's); rescale_factor: 1/255.
        resample: Pillow resampling filter (3 = bicubic).
    """

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    resample: int

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ImageProcessor:
        """The settings of ``model_dir/preprocessor_config.json``.

        Raises:
            ModelLoadError: the file is missing or unreadable, names another image processor type,
                turns off a step this preprocessing always does, or lacks the pixel bounds.
        """
        path = Path(model_dir) / "preprocessor_config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the image processor settings {path}: {exc}") from exc
        kind = config.get("image_processor_type")
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: image processor {kind!r} is not Qwen2-VL's ({', '.join(SUPPORTED_TYPES)})")
        steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        off = [step for step in steps if not config.get(step, True)]
        if off:
            raise ModelLoadError(f"{path}: {', '.join(off)} turned off; MinerU2.5's preprocessing does every step")
        size = config.get("size") or {}
        if not isinstance(size, dict):
            raise ModelLoadError(f"{path}: bad image processor settings: size is {size!r}, not a mapping")
        # transformers reads the bounds from size (shortest/longest edge, or min/max pixels there)
        # and lets top-level min_pixels / max_pixels override them.
        min_pixels = config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        max_pixels = config.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        if min_pixels is None or max_pixels is None:
            raise ModelLoadError(f"{path}: no pixel bounds (size.shortest_edge / longest_edge or min/max_pixels)")
        try:
            if len(config["image_mean"]) != 3 or len(config["image_std"]) != 3:
                raise ValueError("image_mean and image_std need one value per RGB channel")
            return cls(
                min_pixels=int(min_pixels),
                max_pixels=int(max_pixels),
                patch_size=int(config.get("patch_size", 14)),
                merge_size=int(config.get("merge_size", 2)),
                temporal_patch_size=int(config.get("temporal_patch_size", 2)),
                mean=tuple(float(v) for v in config["image_mean"]),  # type: ignore[arg-type]
                std=tuple(float(v) for v in config["image_std"]),  # type: ignore[arg-type]
                rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: bad image processor settings: {exc}") from exc

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` in pixels an image of that size is resized to.

        Raises:
            ValueError: the edge ratio is above ``MAX_EDGE_RATIO``.
        """
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return w, h

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches and grid of one image.

        Args:
            image: any Pillow image; a mode other than RGB goes through ``inputs.documents.to_rgb``
                (transparency on white), as every page image of the pipeline does.

        Returns:
            ``pixel_values``: ``[t*h*w, 3 * temporal_patch_size * patch_size**2]`` float32 (1176
            columns for MinerU2.5), rows in merge-window order; ``grid_thw``: ``(1, h, w)`` in patches.

        Raises:
            ValueError: the edge ratio is above ``MAX_EDGE_RATIO``.
        """
        rgb = image if image.mode == "RGB" else to_rgb(image)
        width, height = self.target_size(*rgb.size)
        resized = rgb.resize((width, height), resample=self.resample)
        scaled = (np.asarray(resized).astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (scaled - np.array(self.mean, dtype=np.float32)) / np.array(self.std, dtype=np.float32)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        # [H, W, C] -> [h/m, w/m, m, m, C, p, p]: merge windows, then the patches of a window, each
        # patch channel-major; the temporal axis repeats the still image.
        patches = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches).reshape(grid_h * grid_w, 3 * t * p * p)
        return torch.from_numpy(flat), (1, grid_h, grid_w)
