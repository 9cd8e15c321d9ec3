"""Command-line flags that build ``ParserOptions``, shared by ``parse`` and ``serve``."""

from __future__ import annotations

import argparse

from .errors import MineruFastError
from .hub import DEFAULT_MODEL_ID
from .options import (
    BACKENDS,
    INT8_KERNELS,
    KV_DTYPES,
    PRECISIONS,
    PRESET_NAMES,
    QUANTIZATIONS,
    TASKS,
    VISION_MODES,
    ParserOptions,
)


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_max_new_tokens(text: str) -> dict[str, int]:
    """``"layout=64,text=32"`` -> ``{"layout": 64, "text": 32}`` (argparse type)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in TASKS or not value.isdigit():
            raise argparse.ArgumentTypeError(f"expected TASK=N with TASK in {TASKS}, got {item!r}")
        out[key] = int(value)
    return out


def add_options_arguments(p: argparse.ArgumentParser) -> None:
    """``--model`` and the flags that override a ``ParserOptions`` preset."""
    p.add_argument("--model", default=DEFAULT_MODEL_ID, help="model directory or hub id (default: %(default)s)")
    p.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="fast",
        help="options preset; auto: chosen for this CPU (default: %(default)s)",
    )
    p.add_argument("--threads", type=positive_int, help="intra-op threads (default: physical cores available)")
    p.add_argument("--page-window", type=positive_int, help="pages whose layout passes and crops are batched together")
    p.add_argument("--precision", choices=PRECISIONS, help="override the preset's precision")
    p.add_argument("--quantization", choices=QUANTIZATIONS, help="override the preset's quantization (all linears)")
    p.add_argument("--int8-kernel", choices=INT8_KERNELS, help="kernel of dynamic INT8 layers (see mineru-fast info)")
    p.add_argument("--vision-mode", choices=VISION_MODES, help="override how the vision encoder runs")
    p.add_argument("--slots", type=positive_int, help="sequences the fast engine decodes together")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="storage dtype of the fast engine's KV buffers")
    p.add_argument("--backend", choices=BACKENDS, help="stock PyTorch, IPEX, or auto (measured faster here)")
    p.add_argument(
        "--max-new-tokens",
        type=parse_max_new_tokens,
        default={},
        metavar="TASK=N,...",
        help=f"per-task generation bounds, tasks {', '.join(TASKS)}",
    )


def options_from_args(args: argparse.Namespace, **fixed: object) -> ParserOptions:
    """The preset named by ``--preset`` with the flags' overrides and ``fixed`` fields applied.

    Raises:
        MineruFastError: an invalid combination (the message of ``ParserOptions``' validation).
    """
    overrides: dict = {"max_new_tokens": args.max_new_tokens, **fixed}
    for flag, field in (("threads", "threads"), ("page_window", "page_window"), ("precision", "precision"),
                        ("vision_mode", "vision_mode"), ("slots", "slots"), ("kv_dtype", "kv_dtype"),
                        ("backend", "backend"), ("int8_kernel", "int8_kernel")):  # fmt: skip
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.quantization is not None:
        overrides.update(vision_quant=args.quantization, lm_quant=args.quantization, lm_head_quant=args.quantization)
    try:
        return ParserOptions.preset(args.preset, **overrides)
    except ValueError as exc:
        raise MineruFastError(str(exc)) from exc
