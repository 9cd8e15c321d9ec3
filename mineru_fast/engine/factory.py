"""Build the engine ``ParserOptions`` ask for, with threads and quantization applied."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..cpu import physical_cores_available
from ..options import ParserOptions
from .base import DTYPES, Engine
from .quantize import Bf16WeightsConfig, Int8DynamicConfig, Int8WeightOnlyConfig

logger = logging.getLogger(__name__)

QUANT_CONFIGS = {
    "int8-dynamic": Int8DynamicConfig(),
    "int8-weight-only": Int8WeightOnlyConfig(),
    "bf16-weights": Bf16WeightsConfig(),
    "none": None,
}


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (default: physical cores available); returns the count."""
    count = threads or physical_cores_available()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    logger.info("torch intra-op threads: %d", count)
    return count


def build_engine(model_dir: Path, options: ParserOptions) -> Engine:
    """The reference or fast engine for ``model_dir`` configured by ``options``.

    Raises:
        ModelLoadError: the checkpoint cannot be loaded.
    """
    set_threads(options.threads)
    if options.engine == "reference":
        from .reference import ReferenceEngine

        return ReferenceEngine(model_dir, precision=options.precision)
    from .generate import FastEngine

    return FastEngine(
        model_dir,
        precision=options.precision,
        slots=options.slots,
        max_seq_len=options.max_seq_len,
        kv_dtype=None if options.kv_dtype == "auto" else DTYPES[options.kv_dtype],
        vision_mode=options.vision_mode,
        vision_quant=QUANT_CONFIGS[options.vision_quant],
        lm_quant=QUANT_CONFIGS[options.lm_quant],
        lm_head_quant=QUANT_CONFIGS[options.lm_head_quant],
        repetition_window=options.repetition_window,
    )
