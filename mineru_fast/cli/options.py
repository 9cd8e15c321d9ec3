"""Command-line flags shared by the commands that load a model: the model and where it comes from
(``--model``, ``--revision``, ``--cache-dir``, ``--token``, ``--offline``), and the flags that
build ``ParserOptions`` (``parse`` and ``serve``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mineru_fast.distributed import PAGES_PER_TASK
from mineru_fast.errors import MineruFastError
from mineru_fast.inputs.documents import DEFAULT_MAX_PAGES
from mineru_fast.options import (
    BACKENDS,
    INT8_KERNELS,
    KV_DTYPES,
    LAYOUT_BACKENDS,
    OCR_MODES,
    PRECISIONS,
    PRESET_NAMES,
    QUANTIZATIONS,
    TASKS,
    TIERS,
    VISION_ATTENTIONS,
    VISION_MODES,
    ParserOptions,
)
from mineru_fast.runtime.hub import DEFAULT_MODEL_ID


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


def add_model_arguments(
    p: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL_ID, help_text: str | None = None
) -> None:
    """``--model`` and the Hugging Face hub flags (the keyword arguments of ``from_pretrained``)."""
    p.add_argument(
        "--model",
        default=default,
        help=help_text
        or "model directory, hub id, or 2509 / pro-2605 for that version's hub id (default: %(default)s)",
    )
    p.add_argument("--revision", help="branch, tag or commit of a hub model (default: its default branch)")
    p.add_argument(
        "--cache-dir", type=Path, help="Hugging Face hub cache (default: huggingface_hub's, HF_HUB_CACHE / HF_HOME)"
    )
    p.add_argument(
        "--token", help="hub token for private or gated models (default: $HF_TOKEN or the stored `hf auth login`)"
    )
    p.add_argument(
        "--offline", action="store_true", help="never download: use the local cache only (as HF_HUB_OFFLINE=1)"
    )
    p.add_argument(
        "--no-prepared-cache",
        action="store_true",
        help="neither read nor write the prepared (quantized) model cache (as MINERU_FAST_PREPARED_CACHE=off)",
    )


def hub_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The hub flags as ``from_pretrained`` / ``resolve_model`` keyword arguments."""
    return {
        "revision": args.revision,
        "cache_dir": args.cache_dir,
        "token": args.token,
        "local_files_only": True if args.offline else None,
    }


def add_parse_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mineru-fast parse`` (also read by ``launch`` to find the inputs)."""
    p.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files, or directories (searched recursively)")
    p.add_argument("-o", "--output", type=Path, required=True, help="writes OUTPUT/<stem>/ per input (see --format)")
    add_format_argument(p)
    p.add_argument("--pages", help="1-based page range, e.g. '1-3,5' (clamped to the document, with a warning)")
    add_max_pages_argument(p)
    p.add_argument("--password", help="user password of encrypted PDFs")
    p.add_argument("--replay", type=Path, help="trace file (one input) or directory of <stem>.json traces")
    add_options_arguments(p)
    p.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "json", "none"),
        default="auto",
        help="per-page progress on stderr: a bar, a line per page, JSON events (one per page and per "
        "input error), or none (auto: bar on a terminal, lines otherwise)",
    )
    p.add_argument("--quiet", action="store_true", help="same as --progress none")
    add_confidence_argument(p)


def add_format_argument(p: argparse.ArgumentParser) -> None:
    """``-f`` / ``--format`` (``formats.FORMATS``), of ``parse``: shaped like mineru 4's ``-f``."""
    from mineru_fast.results.formats import DEFAULT_FORMAT, FORMATS

    p.add_argument(
        "-f",
        "--format",
        choices=FORMATS,
        default=DEFAULT_FORMAT,
        help="bundle: OUTPUT/<stem>/ as MinerU 4 saves it (markdown.md, middle_json.json, structured_content.json, "
        "model_output.json, images/); markdown, middle_json, zip: OUTPUT/<stem>.md|.json|.zip as mineru's -f; "
        "html, latex, docx, epub, pdf: the bundle and OUTPUT/<stem>/<stem>.<suffix> by DocVortex (the mineru4 "
        "extra); 2.x: MinerU 2.x's <stem>.md, <stem>_content_list.json, <stem>.json (default: %(default)s)",
    )


def add_confidence_argument(p: argparse.ArgumentParser) -> None:
    """``--confidence`` (``DocumentWriter(confidence=True)``), of ``parse`` and ``batch``."""
    p.add_argument(
        "--confidence",
        action="store_true",
        help="add the mf_confidence extension field (block token log-probabilities) to structured_content.json "
        "blocks (2.x: content_list.json items)",
    )


def add_max_pages_argument(p: argparse.ArgumentParser) -> None:
    """``--max-pages`` (``ParserOptions.max_pages``), of ``parse`` and ``batch``."""
    p.add_argument(
        "--max-pages",
        type=positive_int,
        default=DEFAULT_MAX_PAGES,
        help="refuse an input that selects more pages than this, before reading any (default: %(default)s)",
    )


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mineru-fast batch`` (``distributed.batch``)."""
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, directories (searched recursively), quoted globs, or pyarrow filesystem URIs "
        "(file://, s3://, gs://, hdfs://: files, folders, globs)",
    )
    p.add_argument("-o", "--output", type=Path, required=True, help="OUTPUT/<stem>/ per input, OUTPUT/manifest.jsonl")
    p.add_argument(
        "-f",
        "--format",
        choices=("bundle", "2.x"),
        default="bundle",
        help="bundle: MinerU 4's (markdown.md, middle_json.json, ...); 2.x: <stem>.md, <stem>_content_list.json, "
        "<stem>.json (default: %(default)s)",
    )
    p.add_argument("--ray-address", help="Ray cluster address, e.g. HEAD:6379 or 'auto' (default: a local Ray)")
    p.add_argument("--actors", type=positive_int, help="parser actors (default: cluster CPUs / --cores-per-actor)")
    p.add_argument("--cores-per-actor", type=positive_int, help="CPUs and threads per actor (default: smallest node's)")
    p.add_argument("--resume", action="store_true", help="skip documents complete in OUTPUT/manifest.jsonl")
    p.add_argument("--max-retries", type=int, default=2, help="more attempts of a task after any failed one (2)")
    p.add_argument(
        "--pages-per-task",
        type=positive_int,
        default=PAGES_PER_TASK,
        help="split a document with more selected pages into tasks of this many pages, run on different actors "
        "(%(default)s)",
    )
    p.add_argument("--pages", help="1-based page range of every input, e.g. '1-3,5' (clamped to each document)")
    add_max_pages_argument(p)
    p.add_argument("--password", help="user password of encrypted PDFs")
    p.add_argument("--replay", type=Path, help="directory of <stem>.json replay traces (tests, benchmarks)")
    add_options_arguments(p)
    p.add_argument(
        "--quiet", action="store_true", help="no progress line for a document that parsed with success (others stay)"
    )
    add_confidence_argument(p)


def add_options_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, the hub flags, and the flags that override a ``ParserOptions`` preset."""
    add_model_arguments(p)
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
    p.add_argument(
        "--vision-attention",
        choices=VISION_ATTENTIONS,
        help="override the vision attention's arithmetic: bf16 (PyTorch's bfloat16 SDPA on AMX CPUs, the own "
        "kernel on other CPUs with AVX-512 BF16) or fp32",
    )
    p.add_argument("--slots", type=positive_int, help="sequences the fast engine decodes together")
    p.add_argument(
        "--speculative",
        type=int,
        metavar="K",
        help="speculative decoding: verify up to K draft tokens per decode step (0-32, at most 7 fit a "
        "step; 6 measured; the same output; drafts from each output's own n-grams and, in the advanced "
        "tier, a PDF's text layer; pages count decode_steps, draft_tokens, accepted_tokens); 0 = off (default)",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="storage dtype of the fast engine's KV buffers")
    p.add_argument("--backend", choices=BACKENDS, help="stock PyTorch, IPEX, or auto (measured faster here)")
    p.add_argument(
        "--tier",
        choices=TIERS,
        help="MinerU 4 tier: standard (PP-DocLayoutV2 layout, PDF text, VLM for the rest) or advanced "
        "(VLM layout and every block); default: standard when --layout-model is given, else advanced",
    )
    p.add_argument(
        "--ocr-mode",
        choices=OCR_MODES,
        help="standard tier: auto (trust the PDF text layer when it passes the checks), txt, or ocr "
        "(read every block from the image) (default: auto)",
    )
    p.add_argument(
        "--layout-model",
        help="PP-DocLayoutV2 for the standard tier: .onnx file, folder or hub id "
        "(default: opendatalab/MinerU-4_models_onnx in the Hugging Face cache)",
    )
    p.add_argument("--layout-backend", choices=LAYOUT_BACKENDS, help="PP-DocLayoutV2 runtime (default: auto)")
    p.add_argument(
        "--max-new-tokens",
        type=parse_max_new_tokens,
        default={},
        metavar="TASK=N,...",
        help=f"per-task generation bounds, tasks {', '.join(TASKS)}",
    )
    p.add_argument(
        "--repetition-window",
        type=int,
        metavar="N",
        help="fast engine loop guard: end a free-running answer whose last N tokens are near-periodic "
        "(finish_reason repetition, its page partial); 0 turns it off (default: the preset's, 512 for fast)",
    )
    p.add_argument(
        "--confidence-threshold",
        type=float,
        metavar="LOGPROB",
        help="flag blocks whose mean token log-probability is below this (<= 0), e.g. -1.0",
    )


def options_from_args(args: argparse.Namespace, **fixed: object) -> ParserOptions:
    """The preset named by ``--preset`` with the flags' overrides and ``fixed`` fields applied.

    Raises:
        MineruFastError: an invalid combination (the message of ``ParserOptions``' validation).
    """
    overrides: dict = {"max_new_tokens": args.max_new_tokens, **fixed}
    for flag, field in (("threads", "threads"), ("page_window", "page_window"), ("precision", "precision"),
                        ("vision_mode", "vision_mode"), ("vision_attention", "vision_attention"),
                        ("slots", "slots"), ("kv_dtype", "kv_dtype"), ("speculative", "speculative"),
                        ("backend", "backend"), ("int8_kernel", "int8_kernel"), ("tier", "tier"),
                        ("ocr_mode", "ocr_mode"), ("layout_model", "layout_model"),
                        ("layout_backend", "layout_backend"), ("repetition_window", "repetition_window"),
                        ("confidence_threshold", "confidence_threshold")):  # fmt: skip
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.quantization is not None:
        overrides.update(vision_quant=args.quantization, lm_quant=args.quantization, lm_head_quant=args.quantization)
    try:
        return ParserOptions.preset(args.preset, **overrides)
    except ValueError as exc:
        raise MineruFastError(str(exc)) from exc
