"""Random-weight models with the exact MinerU2.5 (Qwen2-VL) architecture.

Real weights cannot be downloaded everywhere, so tests and benchmarks run on models that this
module writes: a directory laid out like the published checkpoint (``config.json``,
``generation_config.json``, tokenizer files, chat template, ``preprocessor_config.json``,
``model.safetensors`` with legacy Qwen2-VL tensor names), which
``transformers.Qwen2VLForConditionalGeneration`` and ``AutoProcessor`` load as they would the real
one. Weights are random, so generated text is meaningless: such a model measures cost, never
parsing quality. A synthetic model names the MinerU2.5 version whose protocol it follows in its
``config.json`` ``_name_or_path`` (``protocol.detect_model_version`` reads it): Pro-2605 by default,
as MinerU 4 runs; both versions have the same architecture.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from mineru_fast.errors import MineruFastError
from mineru_fast.protocol.spec import (
    CHAT_TEMPLATE,
    DEFAULT_MODEL_VERSION,
    MINERU_TOKENS,
    MODEL_VERSIONS,
    QWEN2VL_SPECIAL_TOKENS,
)
from mineru_fast.runtime.hub import LM_SOURCE, MARKER, cache_dir, match_file_mode

if TYPE_CHECKING:
    from mineru_fast.engine.gguf_lm import GgufLanguageModel

__all__ = ["ModelSize", "SIZES", "make_synthetic_model", "cached_synthetic_model"]


@dataclass(frozen=True)
class ModelSize:
    """Architecture hyper-parameters of a synthetic model.

    The ``full`` values are MinerU2.5-2509-1.2B's (its published ``config.json``): a Qwen2 language
    model with 24 layers of width 896 (14 query heads, 2 KV heads, head_dim 64) and a Qwen2-VL NaViT
    vision encoder with 32 blocks of width 1280.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    vision_mlp_ratio: int = 4
    vocab_size: int = 151936


SIZES: dict[str, ModelSize] = {
    "full": ModelSize(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        mrope_section=(8, 12, 12),
        vision_depth=32,
        vision_embed_dim=1280,
        vision_num_heads=16,
    ),
    # Same structure (GQA 2:1, M-RoPE sections summing to head_dim/2, merger, tied head) at a
    # size that runs a page in well under a second.
    "tiny": ModelSize(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        mrope_section=(2, 3, 3),
        vision_depth=2,
        vision_embed_dim=32,
        vision_num_heads=2,
    ),
}

# Image processor facts of Qwen2-VL / MinerU2.5 (OpenAI CLIP normalization; 28-pixel grid).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 2048 * 28 * 28
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2


_VERSION_NAMES = {"pro-2605": "MinerU2.5-Pro-2605-1.2B", "2509": "MinerU2.5-2509-1.2B"}


def _config(size: ModelSize, version: str) -> dict:
    """The flat ``config.json`` of a Qwen2-VL checkpoint, as published models carry it, named after
    the version it stands in for (``_name_or_path``)."""
    tokens = {name: i for i, name in enumerate(QWEN2VL_SPECIAL_TOKENS, start=151643)}
    return {
        "_name_or_path": f"mineru-fast/synthetic-{_VERSION_NAMES[version]}",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "torch_dtype": "bfloat16",
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(size.mrope_section)},
        "vocab_size": size.vocab_size,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": size.num_hidden_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": tokens["<|endoftext|>"],
        "eos_token_id": tokens["<|im_end|>"],
        "vision_start_token_id": tokens["<|vision_start|>"],
        "vision_end_token_id": tokens["<|vision_end|>"],
        "vision_token_id": tokens["<|vision_pad|>"],
        "image_token_id": tokens["<|image_pad|>"],
        "video_token_id": tokens["<|video_pad|>"],
        "vision_config": {
            "depth": size.vision_depth,
            "embed_dim": size.vision_embed_dim,
            "mlp_ratio": size.vision_mlp_ratio,
            "num_heads": size.vision_num_heads,
            "in_chans": 3,
            "hidden_size": size.hidden_size,
            "hidden_act": "quick_gelu",
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    }


def _generation_config() -> dict:
    return {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": False,
    }


def _write_processor(out: Path) -> None:
    """Tokenizer (Qwen2 BPE + Qwen2-VL and MinerU added tokens), image processor, chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil

    assets = resources.files("mineru_fast") / "assets" / "qwen2"
    with resources.as_file(assets / "vocab.json") as vocab, resources.as_file(assets / "merges.txt") as merges:
        vocab_map = json.loads(Path(vocab).read_text(encoding="utf-8"))
        merge_lines = [ln for ln in Path(merges).read_text(encoding="utf-8").splitlines()[1:] if ln]
    added = QWEN2VL_SPECIAL_TOKENS + MINERU_TOKENS
    expected = {t: i for i, t in enumerate(added, start=len(vocab_map))}
    # transformers annotates merges as list[str] and unk_token as str; the BPE model under it takes
    # (left, right) pairs and no unknown token, as Qwen2's published tokenizer has.
    tokenizer = Qwen2Tokenizer(
        vocab=vocab_map | expected,  # fixed ids: Qwen2-VL's for its tokens, then MinerU's
        merges=[tuple(m.split(" ")) for m in merge_lines],  # type: ignore[misc]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # type: ignore[arg-type]
        model_max_length=32768,
        errors="replace",
    )
    special = [AddedToken(t, special=True, normalized=False) for t in QWEN2VL_SPECIAL_TOKENS]
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MINERU_TOKENS])
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in expected}
    if got != expected:
        raise MineruFastError(f"synthetic tokenizer ids are off: {got}")
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    # Saved piecewise: building a Qwen2VLProcessor needs torchvision (its video processor).
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _random_tensor(name: str, shape: tuple[int, ...], generator):
    """One parameter, deterministic in (seed, name order).

    Linear and convolution weights get std 1/sqrt(fan_in) so activations keep unit scale through
    depth (greedy decoding then has clear winners, not near-ties); norms get weights near 1 and
    biases near 0, perturbed so that a skipped norm or bias changes the numbers.
    """
    import torch

    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("bias"):
        return 0.02 * torch.randn(shape, generator=generator)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=generator)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def _bpe_vocabulary() -> list[str]:
    """The shipped Qwen2 BPE tokens by id, then Qwen2-VL's special tokens (ids 0..151656)."""
    vocab = json.loads((resources.files("mineru_fast") / "assets" / "qwen2" / "vocab.json").read_text(encoding="utf-8"))
    by_id = sorted(vocab, key=vocab.__getitem__)
    return by_id + QWEN2VL_SPECIAL_TOKENS


def _write_weights(out: Path, config: dict, seed: int, trained: GgufLanguageModel | None = None) -> int:
    """Write ``model.safetensors``; returns the number of parameters.

    With ``trained`` (a GGUF read by ``gguf_lm.read_gguf_lm``) the language model's tensors
    (``model.*``) are the GGUF's, dequantized and stored in bfloat16 like every other tensor; the
    vision tower stays random, drawn first, as without it, so the same seed gives the same vision
    weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from mineru_fast.engine.checkpoint import published_name

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config))
    shapes = {
        published_name(name): tuple(param.shape) for name, param in model.named_parameters() if name != "lm_head.weight"
    }  # the tied lm_head is not listed twice
    if trained is not None:
        trained.check_shapes({name: shape for name, shape in shapes.items() if not name.startswith("visual.")})
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if trained is not None and not name.startswith("visual."):
            continue
        tensors[name] = _random_tensor(name, shape, generator).to(torch.bfloat16)
    if trained is not None:
        for name, values in trained.tensors():
            tensors[name] = torch.from_numpy(values).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def make_synthetic_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    version: str = DEFAULT_MODEL_VERSION,
    lm_gguf: str | Path | None = None,
) -> Path:
    """Write a random-weight MinerU2.5-architecture model directory.

    Args:
        out_dir: directory to create (parents too); existing model files in it are overwritten.
        size: ``"tiny"`` (tests, ~10 M parameters, mostly the 151936-row embedding) or ``"full"``
            (MinerU2.5 shapes, about 1.156 B parameters, 2.3 GB of bf16 safetensors).
        seed: seed of the weight generator; the same seed gives byte-identical weights.
        version: the MinerU2.5 version whose protocol the model follows (``protocol.MODEL_VERSIONS``,
            default Pro-2605); the weights do not depend on it.
        lm_gguf: a GGUF of a trained Qwen2 language model of the size's exact shape (with
            ``"full"``: Qwen2.5-0.5B's); its weights, dequantized, replace the random language
            model (the vision tower stays random) and ``LM_SOURCE.json`` records where they came
            from. Needs the optional ``gguf`` package (see ``gguf_lm``).

    Returns:
        The model directory, loadable by ``DocumentParser.from_pretrained`` and by transformers.

    Raises:
        ValueError: unknown ``size`` or ``version``.
        GgufError: ``lm_gguf`` cannot be read or does not fit the size (``gguf_lm.read_gguf_lm``).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if version not in MODEL_VERSIONS:
        raise ValueError(f"version must be one of {MODEL_VERSIONS}, got {version!r}")
    config = _config(SIZES[size], version)
    trained = None
    if lm_gguf is not None:  # read before anything is written: a GGUF that does not fit leaves no files
        from mineru_fast.engine.gguf_lm import read_gguf_lm

        trained = read_gguf_lm(Path(lm_gguf), config, _bpe_vocabulary())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)  # written last: a half-written model has none
    (out / LM_SOURCE).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(), indent=2) + "\n")
    _write_processor(out)
    n_params = _write_weights(out, config, seed, trained)
    provenance = None if trained is None else trained.provenance()
    match_file_mode([out / "model.safetensors"], like=out / "config.json")
    if provenance is None:
        note = (
            f"Random-weight model written by mineru-fast (size={size}, seed={seed}, version={version}, "
            f"{n_params:,} parameters).\n"
            "Its outputs are meaningless; use it to measure speed and memory, never quality.\n"
        )
    else:
        (out / LM_SOURCE).write_text(json.dumps(provenance, indent=2) + "\n")
        note = (
            f"Model written by mineru-fast (size={size}, seed={seed}, version={version}, {n_params:,} "
            "parameters): a random vision\n"
            f"encoder and a trained language model, {provenance['gguf_name']!r} dequantized from\n"
            f"{provenance['gguf_file']} "
            f"({LM_SOURCE} says how). Its page outputs are meaningless (the LM never saw MinerU's task or\n"
            "these image features); use it to judge numerics on trained language-model weights.\n"
        )
    (out / MARKER).write_text(note)
    return out


def cached_synthetic_model(size: str = "full", seed: int = 0, cache: str | Path | None = None) -> Path:
    """A synthetic model made once and reused: ``<cache>/synthetic-<size>-seed<seed>``, ``cache``
    defaulting to the package cache (``hub.cache_dir()``: ``$MINERU_FAST_CACHE`` or
    ``~/.cache/mineru-fast``)."""
    path = Path(cache or cache_dir()) / f"synthetic-{size}-seed{seed}"
    if not (path / MARKER).is_file():  # written last: a half-written model is redone
        make_synthetic_model(path, size, seed)
    return path
