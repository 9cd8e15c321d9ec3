"""A trained Qwen2 language model read from a GGUF file, under a MinerU2.5 checkpoint's tensor names.

No MinerU2.5 weights can be downloaded everywhere, but a trained Qwen2 of exactly its language
model's shape can (Qwen2.5-0.5B: 24 blocks of width 896, 14 query / 2 KV heads, FFN 4864,
vocabulary 151,936, rope theta 1e6, RMS eps 1e-6). ``read_gguf_lm`` dequantizes such a GGUF with
the ``gguf`` package (numpy; an optional dependency, imported here only) and returns its tensors
named as a published Qwen2-VL checkpoint names its language model (``model.layers.N.*``), so
``engine.synthetic.make_synthetic_model(..., lm_gguf=...)`` can put a trained LM beside a random vision
encoder: a fixture on which reduced-precision numerics can be judged (random weights give nearly
flat logits).

Facts the mapping relies on:

- Names: llama.cpp's ``qwen2`` tensor names (``blk.N.attn_q``, ``ffn_gate``, ...; the ``gguf``
  package's ``TensorNameMap`` for ``MODEL_ARCH.QWEN2``, which the tests check ``GGUF_NAMES``
  against).
- Shapes: GGUF lists a tensor's dimensions fastest-varying first (``ne0`` = input features), so
  ``[896, 128]`` is PyTorch's ``[128, 896]`` (``[out, in]``); the dequantized rows come out in
  PyTorch's order.
- Query / key rows are not permuted: llama.cpp's converter (``convert_hf_to_gguf.py``) permutes
  them only for its LLaMA-family classes, whose rope pairs adjacent dimensions, while its
  ``Qwen2Model`` keeps Hugging Face's order, and llama.cpp runs ``qwen2`` with NEOX rope
  (rotate-half, the order transformers and this engine use).
- The output head: MinerU2.5 ties it to the embedding (``tie_word_embeddings``). A GGUF may hold
  the same matrix twice at different precisions (Qwen2.5-0.5B is tied; its Q4_K_M file stores a
  Q5_0 ``token_embd`` and a Q8_0 ``output``). The more precise of the two is written as the one
  tied table, after checking they are the same matrix up to quantization (relative difference at
  most ``TIED_TOLERANCE``); two different matrices cannot be tied and are refused.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mineru_fast.errors import GgufError

__all__ = ["GGUF_NAMES", "TIED_TOLERANCE", "GgufLanguageModel", "read_gguf_lm"]

# Published Qwen2-VL language-model names -> GGUF names ({i}: the block index).
GGUF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
OUTPUT_NAME = "output.weight"
# Largest relative Frobenius difference of token_embd and output for them to count as one matrix
# stored twice. Measured on Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file: 0.044 (Q5_0 against Q8_0),
# which is Q5_0's own rounding (0.043 when the Q8_0 table is quantized to Q5_0, and 96.9 % of the
# values then equal the stored Q5_0 ones). Two independent matrices of equal scale differ by ~1.4.
TIED_TOLERANCE = 0.1

# config.json key -> GGUF metadata key (after "<arch>.") of the hyper-parameters that must agree.
_HYPERPARAMETERS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise GgufError("reading a GGUF file needs the gguf package: pip install gguf") from exc
    return gguf


@dataclass
class GgufLanguageModel:
    """The language model of a GGUF file, checked against a checkpoint's ``config.json``.

    Attributes:
        path: the GGUF file.
        name: its ``general.name`` (e.g. ``"Qwen2.5 Coder 0.5B Instruct AWQ"``).
        size_bytes: the file's size in bytes.
        sha256: hex SHA-256 of the file.
        tensor_types: GGML type name -> number of tensors of that type.
        head: how the output head was handled (a sentence, for the model's provenance note).
    """

    path: Path
    name: str
    size_bytes: int
    sha256: str
    tensor_types: dict[str, int]
    head: str
    _reader: Any = field(repr=False)
    _sources: dict[str, str] = field(repr=False)  # published name -> GGUF name

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(published name, float32 array)`` for every language-model tensor, dequantized one at
        a time, in PyTorch's shape (``[out, in]`` for a linear weight)."""
        gguf = _gguf()
        by_name = {t.name: t for t in self._reader.tensors}
        for ours, theirs in self._sources.items():
            tensor = by_name[theirs]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(n) for n in reversed(tensor.shape))
            yield (
                ours,
                np.array(values.reshape(shape), dtype=np.float32, order="C"),
            )  # a copy: F32 data is the file's map

    def check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Check the GGUF's tensors against the checkpoint's language-model shapes (published
        names -> PyTorch shapes), without dequantizing.

        Raises:
            GgufError: the two name sets differ, or a shape does.
        """
        by_name = {t.name: t for t in self._reader.tensors}
        missing, extra = sorted(set(shapes) - set(self._sources)), sorted(set(self._sources) - set(shapes))
        if missing or extra:
            raise GgufError(f"names differ: no GGUF tensor for {missing[:3]}, no checkpoint slot for {extra[:3]}")
        for ours, want in shapes.items():
            got = tuple(int(n) for n in reversed(by_name[self._sources[ours]].shape))
            if got != tuple(want):
                theirs = self._sources[ours]
                raise GgufError(f"{theirs} is {list(got)} (PyTorch order); the checkpoint's {ours} is {list(want)}")

    def provenance(self) -> dict[str, Any]:
        """JSON-ready facts of the source: file name, ``general.name``, size, SHA-256, tensor
        types and the head's handling."""
        return {
            "gguf_file": self.path.name,
            "gguf_name": self.name,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "tensor_types": self.tensor_types,
            "head": self.head,
        }


def _field(reader: Any, key: str) -> Any:
    found = reader.get_field(key)
    if found is None:
        raise GgufError(f"the GGUF has no {key!r} metadata")
    return found.contents()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _bits_per_weight(gguf: Any, tensor: Any) -> float:
    block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    return 8 * size / block


def _check_hyperparameters(reader: Any, config: dict) -> None:
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise GgufError(f"the GGUF's architecture is {arch!r}; only a 'qwen2' language model fits MinerU2.5")
    for ours, theirs in _HYPERPARAMETERS.items():
        got, want = _field(reader, f"qwen2.{theirs}"), config[ours]
        if not math.isclose(float(got), float(want), rel_tol=1e-5):  # the GGUF stores eps as float32
            raise GgufError(f"the GGUF's qwen2.{theirs} is {got}, the checkpoint's {ours} is {want}")


def _check_vocabulary(reader: Any, vocabulary: list[str]) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens[: len(vocabulary)] != vocabulary:
        first = next(i for i, (a, b) in enumerate(zip(tokens, vocabulary, strict=False)) if a != b)
        shown = tokens[first] if first < len(tokens) else "(none)"
        raise GgufError(
            f"the GGUF's vocabulary differs from the checkpoint's tokenizer at id {first}: "
            f"{shown!r} against {vocabulary[first]!r}"
        )


def _head_choice(gguf: Any, by_name: dict[str, Any], tied: bool) -> tuple[str, str]:
    """``(GGUF name of the embedding table to write, sentence saying why)``."""
    embed = by_name["token_embd.weight"]
    output = by_name.get(OUTPUT_NAME)
    if output is None:
        return embed.name, "no output.weight in the GGUF: the head is the embedding table (tied), as stored"
    if not tied:
        raise GgufError("the checkpoint's head is untied; only tied MinerU2.5 checkpoints take a GGUF language model")
    if list(output.shape) != list(embed.shape):
        raise GgufError(f"output.weight {list(output.shape)} and token_embd.weight {list(embed.shape)} differ in shape")
    a = gguf.quants.dequantize(embed.data, embed.tensor_type)
    b = gguf.quants.dequantize(output.data, output.tensor_type)
    difference = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))
    del a, b
    if difference > TIED_TOLERANCE:
        raise GgufError(
            f"output.weight and token_embd.weight differ by {difference:.3f} (relative): two matrices, "
            "which MinerU2.5's tied head cannot hold"
        )
    best = max((embed, output), key=lambda t: _bits_per_weight(gguf, t))
    other = output if best is embed else embed
    return best.name, (
        f"tied: {best.name} ({best.tensor_type.name}) is the embedding and head table; {other.name} "
        f"({other.tensor_type.name}) is the same matrix stored less precisely (relative difference "
        f"{difference:.4f}) and is not used"
    )


def read_gguf_lm(path: str | Path, config: dict, vocabulary: list[str] | None = None) -> GgufLanguageModel:
    """Open a Qwen2 GGUF and check that its language model fits a checkpoint.

    Args:
        path: the GGUF file (any tensor types the ``gguf`` package dequantizes: F32, F16, BF16,
            Q4_0 ... Q8_0, the K-quants).
        config: the checkpoint's flat ``config.json`` (Qwen2-VL layout: ``num_hidden_layers``,
            ``hidden_size``, ..., ``vocab_size``, ``tie_word_embeddings``).
        vocabulary: the checkpoint tokenizer's tokens by id (byte-level BPE strings, as
            ``vocab.json`` spells them) that the GGUF's vocabulary must begin with; None skips the
            check.

    Returns:
        The checked model; its ``tensors()`` dequantize on demand.

    Raises:
        GgufError: the ``gguf`` package is missing; the file is not a GGUF, not ``qwen2``, or its
            hyper-parameters, vocabulary, tensor names or shapes differ from the checkpoint's; or
            its output head cannot be tied (see the module docstring).
    """
    gguf = _gguf()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise GgufError(f"cannot read {path.name} as a GGUF file: {exc}") from exc
    _check_hyperparameters(reader, config)
    if vocabulary is not None:
        _check_vocabulary(reader, vocabulary)
    by_name = {t.name: t for t in reader.tensors}
    embed_source, head = _head_choice(gguf, by_name, bool(config.get("tie_word_embeddings", False)))
    sources = {}
    for ours, theirs in GGUF_NAMES.items():
        blocks = range(config["num_hidden_layers"]) if "{i}" in ours else [None]
        for i in blocks:
            sources[ours.format(i=i)] = theirs.format(i=i)
    sources["model.embed_tokens.weight"] = embed_source
    missing = sorted(set(sources.values()) - set(by_name))
    if missing:
        raise GgufError(f"the GGUF lacks {len(missing)} language-model tensor(s), e.g. {missing[:3]}")
    unused = sorted(set(by_name) - set(sources.values()) - {OUTPUT_NAME, "token_embd.weight"})
    if unused:
        raise GgufError(f"the GGUF has tensors with no place in MinerU2.5's language model, e.g. {unused[:3]}")
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return GgufLanguageModel(
        path=path,
        name=str(_field(reader, "general.name")) if reader.get_field("general.name") else path.stem,
        size_bytes=path.stat().st_size,
        sha256=_sha256(path),
        tensor_types=types,
        head=head,
        _reader=reader,
        _sources=sources,
    )
