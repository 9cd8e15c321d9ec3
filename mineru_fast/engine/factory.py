"""Build the engine ``ParserOptions`` ask for, with threads and quantization applied.

The built engine carries ``engine.numerics``: ``numerics.describe(options)`` (ISA class, precision,
native or emulated bfloat16, INT8 kernel and why) for result metadata; where a part asks for
block-wise INT8 (the fast preset's language model), ``lm_int8_block``: the own kernel's
instruction-set path that runs it, or why the PyTorch form of the same arithmetic runs; and,
where the language model's per-channel INT8 is oneDNN's, ``lm_decode_kernel``: whether its
decode rows run on the own GEMV (``engine.kernels``; the same numerics) or why not; for the fast
engine, ``vision_attention``: what runs the vision encoder's attention (the own bfloat16 kernel
or PyTorch's SDPA, and why), and ``lm_decode_attention``: what runs the language model's
decode-step attention (the own float32 kernel or PyTorch's operators, and why).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mineru_fast.engine.base import DTYPES
from mineru_fast.engine.interface import Engine
from mineru_fast.engine.kernels import kernel_status
from mineru_fast.engine.memory import pin_mmap_threshold
from mineru_fast.engine.numerics import describe, warn_if_emulated_bf16
from mineru_fast.engine.quantize import Bf16WeightsConfig, Int8BlockConfig, Int8DynamicConfig, Int8WeightOnlyConfig
from mineru_fast.options import TASKS, ParserOptions
from mineru_fast.protocol.spec import sampling_for
from mineru_fast.runtime.hub import prepared_cache_root
from mineru_fast.runtime.threads import in_fresh_thread, set_torch_threads

logger = logging.getLogger(__name__)

QUANT_CONFIGS = {
    "int8-block": Int8BlockConfig(),
    "int8-weight-only": Int8WeightOnlyConfig(),
    "bf16-weights": Bf16WeightsConfig(),
    "none": None,
}  # "int8-dynamic": Int8DynamicConfig of the kernel choice.choose_int8_kernel resolves


def build_engine(model_dir: Path, options: ParserOptions, prepared_cache: bool | None = None) -> Engine:
    """The reference or fast engine for ``model_dir`` configured by ``options``.

    Loading, quantization and kernel checks run in a thread of their own that ends before this
    returns, so the calling thread never starts an OpenMP pool (``threads.in_fresh_thread``).
    Page-sized buffers are kept out of the heap from here on (``memory.pin_mmap_threshold``).

    Args:
        model_dir: checkpoint directory.
        options: parser options.
        prepared_cache: read and write the fast engine's prepared (quantized) model under
            ``hub.cache_dir() / "prepared"`` (see ``engine.prepared``); None = yes unless
            ``$MINERU_FAST_PREPARED_CACHE`` is ``0``/``off`` (a folder there moves the cache).

    Raises:
        ModelLoadError: the checkpoint cannot be loaded.
    """
    set_torch_threads(options.threads)
    pin_mmap_threshold()
    root = prepared_cache_root(prepared_cache)
    return in_fresh_thread(lambda: _build(model_dir, options, root))


def _build(model_dir: Path, options: ParserOptions, cache_root: Path | None) -> Engine:
    warn_if_emulated_bf16(options)
    numerics = describe(options)
    if options.engine == "reference":
        from mineru_fast.engine.reference import ReferenceEngine

        reference = ReferenceEngine(model_dir, precision=options.precision)
        reference.numerics = numerics
        return reference
    from mineru_fast.engine.backends import apply_ipex, choose_backend
    from mineru_fast.engine.generate import FastEngine

    configs = {**QUANT_CONFIGS, "int8-dynamic": Int8DynamicConfig(numerics["int8_kernel"] or "auto")}
    choice = choose_backend(options.backend)
    quants = {part: getattr(options, f"{part}_quant") for part in ("vision", "lm", "lm_head")}
    if "int8-block" in quants.values():  # the same arithmetic on every machine: only its speed varies
        numerics["lm_int8_block"] = kernel_status().reason
    int8_parts = {part: q in ("int8-dynamic", "int8-block") for part, q in quants.items()}
    ipex_int8 = choice.backend == "ipex" and choice.int8 == "ipex"
    if ipex_int8 and any(int8_parts.values()):
        numerics.update(
            int8_kernel="ipex", int8_kernel_path="IPEX INT8 linear (WoqLowpMode.INT8)", int8_reason=choice.reason
        )
        numerics.pop("lm_int8_block", None)  # IPEX's INT8 replaces the block-wise layers too

    lm_configs = configs
    lm_per_channel = "int8-dynamic" in (quants["lm"], quants["lm_head"])
    if options.int8_kernel == "auto" and numerics["int8_kernel"] == "onednn" and lm_per_channel and not ipex_int8:
        # The language model's decode rows on the own GEMV (oneDNN's numerics, bit for bit);
        # vision, all GEMMs of many rows, stays on oneDNN's prepacked kernel.
        status = kernel_status()
        numerics["lm_decode_kernel"] = status.gemv_reason
        if status.gemv is not None:
            lm_configs = {**configs, "int8-dynamic": Int8DynamicConfig("gemv")}

    def quant(part: str) -> object | None:  # IPEX's INT8 starts from the float layer
        if ipex_int8 and int8_parts[part]:
            return None
        return (configs if part == "vision" else lm_configs)[quants[part]]

    engine = FastEngine(
        model_dir,
        precision=options.precision,
        slots=options.slots,
        max_seq_len=options.max_seq_len,
        # room for the protocol's own bounds too: replayed requests run without the options' bounds
        max_new_tokens=max(max(options.sampling(t).max_new_tokens, sampling_for(t).max_new_tokens) for t in TASKS),
        kv_dtype=None if options.kv_dtype == "auto" else DTYPES[options.kv_dtype],
        vision_mode=options.vision_mode,
        vision_attention=options.vision_attention,
        vision_quant=quant("vision"),
        lm_quant=quant("lm"),
        lm_head_quant=quant("lm_head"),
        repetition_window=options.repetition_window,
        prepared_cache=cache_root,
    )
    numerics["vision_attention"] = engine.vision_attention_reason
    numerics["lm_decode_attention"] = engine.decode_attention_reason
    logger.info("backend: %s (%s)", choice.backend, choice.reason)
    logger.info("vision attention: %s", engine.vision_attention_reason)
    logger.info("decode attention: %s", engine.decode_attention_reason)
    if numerics["int8_kernel"]:
        logger.info("INT8 kernel: %s (%s)", numerics["int8_kernel_path"], numerics["int8_reason"])
    if numerics.get("lm_int8_block"):
        logger.info("LM block-wise INT8: %s", numerics["lm_int8_block"])
    if numerics.get("lm_decode_kernel"):
        logger.info("LM decode rows: %s", numerics["lm_decode_kernel"])
    if choice.backend == "ipex":
        apply_ipex(engine, int8_parts, ipex_int8)
    engine.numerics = numerics
    return engine
