"""Random-weight PP-DocLayoutV2 models of the exact architecture, for tests and benchmarks.

``make_synthetic_doclayout`` writes a directory holding both forms the real model is published
in: a transformers checkpoint (``config.json``, ``preprocessor_config.json``,
``model.safetensors``; what ``PaddlePaddle/PP-DocLayoutV2_safetensors`` holds) and an ONNX graph
with the published graph's signature (``inference.onnx``: inputs ``im_shape``, ``image``,
``scale_factor`` with a dynamic batch, outputs rows ``[B*300, 8]`` and per-page counts ``[B]``
int32; see ``inference``), exported from the same weights with ``torch.onnx`` (dynamo). Weights
are random: outputs measure cost, never quality.

Weights: linear kernels N(0, 1/fan_in), convolution kernels N(0, 2/fan_in) (so the ReLU backbone
passes a signal through its depth instead of a constant), embeddings N(0, 0.02^2), biases near 0,
norm scales near 1, and class-score biases near -2.8: a text page then yields some tens of
detections above the class thresholds (as a trained model does) rather than none or hundreds.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

from mineru_fast.errors import MineruFastError
from mineru_fast.layout.labels import CLASS_ORDER, CLASS_THRESHOLDS, INPUT_SIZE, LABELS
from mineru_fast.runtime.hub import MARKER, match_file_mode

__all__ = ["ARCHITECTURES", "make_synthetic_doclayout", "cached_synthetic_doclayout"]

# The published architecture (PaddlePaddle/PP-DocLayoutV2_safetensors, as transformers 5's
# PPDocLayoutV2Config documents it): HGNetV2-L backbone, RT-DETR hybrid encoder and 6-layer
# decoder with 300 queries at width 256, and a 6-layer LayoutLMv3-style reading-order encoder of
# width 512: 53,556,083 parameters with the 25 labels, 214 MB in float32 (204.3 MiB; PaddleOCR lists
# the model at 203.8 MB).
_FULL: dict[str, Any] = {
    "backbone_config": {
        "model_type": "hgnet_v2",
        "arch": "L",
        "stem_channels": [3, 32, 48],
        "stem_strides": [2, 1, 1, 2, 1],
        "stage_in_channels": [48, 128, 512, 1024],
        "stage_mid_channels": [48, 96, 192, 384],
        "stage_out_channels": [128, 512, 1024, 2048],
        "stage_num_blocks": [1, 1, 3, 1],
        "stage_downsample": [False, True, True, True],
        "stage_light_block": [False, False, True, True],
        "stage_kernel_size": [3, 3, 5, 5],
        "stage_numb_of_layers": [6, 6, 6, 6],
        "hidden_sizes": [256, 512, 1024, 2048],
        "depths": [3, 4, 6, 3],
        "embedding_size": 64,
        "hidden_act": "relu",
        "use_learnable_affine_block": False,
        "out_features": ["stage2", "stage3", "stage4"],
        "return_idx": [1, 2, 3],
        "freeze_at": 0,
        "freeze_norm": True,
        "freeze_stem_only": True,
        "lr_mult_list": [0, 0.05, 0.05, 0.05, 0.05],
    },
    "encoder_in_channels": [512, 1024, 2048],
    "feat_strides": [8, 16, 32],
    "encoder_hidden_dim": 256,
    "encoder_layers": 1,
    "encoder_ffn_dim": 1024,
    "encoder_attention_heads": 8,
    "encode_proj_layers": [2],
    "encoder_activation_function": "gelu",
    "activation_function": "silu",
    "hidden_expansion": 1.0,
    "d_model": 256,
    "num_queries": 300,
    "decoder_in_channels": [256, 256, 256],
    "decoder_ffn_dim": 1024,
    "num_feature_levels": 3,
    "decoder_n_points": 4,
    "decoder_layers": 6,
    "decoder_attention_heads": 8,
    "decoder_activation_function": "relu",
    "reading_order_config": {
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_hidden_layers": 6,
        "intermediate_size": 2048,
        "hidden_act": "gelu",
        "coordinate_size": 171,
        "shape_size": 170,
        "num_classes": 20,
        "max_position_embeddings": 514,
        "max_2d_position_embeddings": 1024,
        "global_pointer_head_size": 64,
        "relation_bias_embed_dim": 16,
        "has_relative_attention_bias": False,
        "has_spatial_attention_bias": True,
    },
}

# Same structure (three feature levels, 300 queries, reading-order head over them) at a size
# whose forward takes well under a second.
_TINY: dict[str, Any] = {
    **_FULL,
    "backbone_config": {
        **_FULL["backbone_config"],
        "stem_channels": [3, 16, 16],
        "stage_in_channels": [16, 16, 32, 64],
        "stage_mid_channels": [16, 16, 16, 32],
        "stage_out_channels": [16, 32, 64, 128],
        "stage_num_blocks": [1, 1, 1, 1],
        "stage_numb_of_layers": [2, 2, 2, 2],
        "hidden_sizes": [16, 32, 64, 128],
    },
    "encoder_in_channels": [32, 64, 128],
    "encoder_hidden_dim": 32,
    "encoder_ffn_dim": 64,
    "encoder_attention_heads": 2,
    "d_model": 32,
    "decoder_in_channels": [32, 32, 32],
    "decoder_ffn_dim": 64,
    "decoder_layers": 2,
    "decoder_attention_heads": 2,
    "reading_order_config": {
        **_FULL["reading_order_config"],
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "coordinate_size": 8,
        "shape_size": 8,
        "global_pointer_head_size": 16,
    },
}

ARCHITECTURES: dict[str, dict[str, Any]] = {"full": _FULL, "tiny": _TINY}

# Image processor of the published checkpoint (preprocessor_config.json): 800x800 bicubic, 1/255.
_PREPROCESSOR = {
    "image_processor_type": "PPDocLayoutV2ImageProcessor",
    "do_resize": True,
    "size": {"height": INPUT_SIZE[0], "width": INPUT_SIZE[1]},
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0, 0, 0],
    "image_std": [1, 1, 1],
}
_CLASS_BIAS = -2.8


def _config(size: str):
    from transformers import PPDocLayoutV2Config

    return PPDocLayoutV2Config(
        **ARCHITECTURES[size],
        id2label=dict(enumerate(LABELS)),
        class_thresholds=list(CLASS_THRESHOLDS),
        class_order=list(CLASS_ORDER),
        architectures=["PPDocLayoutV2ForObjectDetection"],
    )


def _randomize(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    embeddings = {f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, torch.nn.Embedding)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            noise = torch.randn(shape, generator=generator)
            if name.endswith("bias") and ("class_embed" in name or "enc_score_head" in name):
                value = _CLASS_BIAS + 0.02 * noise
            elif name.endswith("bias"):
                value = 0.02 * noise
            elif param.dim() == 1:  # norm scales
                value = 1.0 + 0.1 * noise
            elif name in embeddings:
                value = 0.02 * noise
            else:  # ReLU convolutions keep their activations' scale with twice the variance (He)
                gain = 2.0 if param.dim() == 4 else 1.0
                value = noise * math.sqrt(gain / math.prod(shape[1:]))
            param.copy_(value)


@contextlib.contextmanager
def _gather_for_export():
    """transformers' model calls ``torch.take_along_dim``, whose export decomposition fixes the
    batch size; with full-shape indices it equals ``torch.gather``, used here while exporting."""
    import torch

    def by_gather(input: torch.Tensor, indices: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.gather(input, dim, indices)

    original = torch.take_along_dim
    setattr(torch, "take_along_dim", by_gather)  # noqa: B010 (a module function, replaced for the export)
    try:
        yield
    finally:
        setattr(torch, "take_along_dim", original)  # noqa: B010


def _export_onnx(model, path: Path) -> None:
    import torch

    from mineru_fast.layout.inference import rows_from_outputs

    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise MineruFastError("writing the ONNX graph needs onnx and onnxscript: pip install onnx onnxscript") from exc

    class PaddleSignature(torch.nn.Module):
        """The published graph's inputs and outputs around the transformers model."""

        def __init__(self, detector) -> None:
            super().__init__()
            self.detector = detector

        def forward(self, im_shape, image, scale_factor):
            out = self.detector(pixel_values=image)
            page_hw = (im_shape / scale_factor).round()
            rows = rows_from_outputs(out.logits, out.pred_boxes, out.order_logits, page_hw)
            counts = torch.full((image.shape[0],), rows.shape[1], dtype=torch.int32)
            return rows.reshape(-1, rows.shape[-1]), counts

    height, width = INPUT_SIZE
    example = (
        torch.tensor([[height, width]] * 2, dtype=torch.float32),
        torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(0)),
        torch.tensor([[height / 1100, width / 850], [height / 842, width / 595]], dtype=torch.float32),
    )
    batch = torch.export.Dim("batch", min=1, max=64)
    with _gather_for_export(), warnings.catch_warnings():
        # torch.export's notes on transformers internals (output capturing, pytree) are not ours to act on.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(
            PaddleSignature(model).eval(), example, dynamic_shapes=({0: batch}, {0: batch}, {0: batch}), strict=True
        )
        onnx_program = torch.onnx.export(
            program,
            input_names=["im_shape", "image", "scale_factor"],
            output_names=["rows", "counts"],
            dynamo=True,
            verbose=False,
        )
    if onnx_program is None:
        raise MineruFastError("torch.onnx.export returned no program")
    onnx_program.save(str(path), external_data=False)


def make_synthetic_doclayout(out_dir: str | Path, size: str = "tiny", seed: int = 0, onnx: bool = True) -> Path:
    """Write a random-weight PP-DocLayoutV2 (transformers checkpoint and, optionally, ONNX graph).

    Args:
        out_dir: directory to create (parents too); model files in it are overwritten.
        size: ``"tiny"`` (tests) or ``"full"`` (the published architecture, ~214 MB per form).
        seed: weight generator seed; the same seed gives identical weights.
        onnx: also export ``inference.onnx`` (needs ``onnx`` and ``onnxscript``; about a minute
            on 2 cores).

    Returns:
        The directory, loadable by ``LayoutDetector.from_pretrained`` (ONNX when present and
        onnxruntime is installed) and by transformers.

    Raises:
        ValueError: unknown ``size``.
        MineruFastError: ``onnx=True`` without onnx/onnxscript installed.
    """
    from transformers import PPDocLayoutV2ForObjectDetection

    if size not in ARCHITECTURES:
        raise ValueError(f"size must be one of {sorted(ARCHITECTURES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    config = _config(size)
    config._attn_implementation = "eager"  # exportable attention; same math as SDPA
    config.reading_order_config._attn_implementation = "eager"
    model = PPDocLayoutV2ForObjectDetection(config).eval()  # every parameter is overwritten below
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR, indent=2) + "\n")
    match_file_mode(sorted(out.glob("*.safetensors")), like=out / "preprocessor_config.json")
    if onnx:
        _export_onnx(model, out / "inference.onnx")
    n_params = sum(p.numel() for p in model.parameters())
    forms = "transformers checkpoint + inference.onnx" if onnx else "transformers checkpoint"
    (out / MARKER).write_text(
        f"Random-weight PP-DocLayoutV2 written by mineru-fast (size={size}, seed={seed}, {n_params:,} parameters; "
        f"{forms}).\nIts detections are meaningless; use it to measure speed and memory, never quality.\n"
    )
    return out


def cached_synthetic_doclayout(size: str = "full", seed: int = 0, cache: str | Path | None = None) -> Path:
    """A synthetic PP-DocLayoutV2 (both forms) made once and reused:
    ``<cache>/synthetic-doclayout-<size>-seed<seed>``, where ``cache`` defaults to ``hub.cache_dir()``."""
    from mineru_fast.runtime.hub import cache_dir

    root = Path(cache) if cache is not None else cache_dir()
    path = root / f"synthetic-doclayout-{size}-seed{seed}"
    if not (path / MARKER).is_file():  # written last: a half-written model is redone
        make_synthetic_doclayout(path, size, seed)
    return path
