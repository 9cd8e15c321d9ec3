"""Read a MinerU2.5 / Qwen2-VL checkpoint directory into the fast engine's modules.

The Hugging Face tensor names are mapped once at load; q/k/v and gate/up are concatenated into
the fused projections; the 3-D patch convolution (kernel = stride) becomes a linear layer.
Both the published layout (``visual.*``, ``model.layers.*``) and transformers 5's
(``model.visual.*``, ``model.language_model.*``) are accepted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .model import Qwen2LM, TextConfig
from .vision import VisionConfig, VisionEncoder


def read_configs(model_dir: Path) -> tuple[TextConfig, VisionConfig]:
    """Text and vision hyper-parameters from ``config.json`` (flat or nested ``text_config``)."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = {**raw, **raw.get("text_config", {})}
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    vision = raw["vision_config"]
    text_config = TextConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"],
        rms_norm_eps=text["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", text.get("rope_theta", 1000000.0)),
        mrope_section=tuple(rope["mrope_section"]),
        tie_word_embeddings=raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
    )
    vision_config = VisionConfig(
        depth=vision["depth"],
        embed_dim=vision["embed_dim"],
        num_heads=vision["num_heads"],
        mlp_ratio=vision["mlp_ratio"],
        out_hidden_size=vision.get("hidden_size", text_config.hidden_size),
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_chans", vision.get("in_channels", 3)),
    )
    return text_config, vision_config


def published_name(name: str) -> str:
    """A transformers 5 parameter name -> the name published Qwen2-VL checkpoints use
    (``model.visual.*`` -> ``visual.*``, ``model.language_model.*`` -> ``model.*``); others unchanged."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class _Tensors:
    """The tensors of all ``*.safetensors`` files of a directory, each read into its own memory
    only when asked for, in its stored dtype.

    The safetensors layout (8-byte little-endian header length, JSON header of dtype / shape /
    byte offsets, then the data) is read with plain file reads rather than a memory map: a map
    keeps every page it has touched resident, and counted in the process's RSS, for as long as any
    tensor of the file is alive, so a loaded model would carry the whole checkpoint as well.
    """

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors in {model_dir}")
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                self._where[published_name(name)] = (path, 8 + length, entry)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, data_start, entry = self._where[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
        if tensor.numel() * tensor.element_size() != end - begin:
            raise ValueError(f"{name}: {end - begin} bytes stored for shape {entry['shape']} {entry['dtype']}")
        with path.open("rb") as f:
            f.seek(data_start + begin)
            if f.readinto(tensor.view(-1).view(torch.uint8).numpy().data) != end - begin:
                raise ValueError(f"{name}: {path.name} is truncated")
        return tensor

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self._where else None


def _vision_state(t: _Tensors, config: VisionConfig) -> dict[str, torch.Tensor]:
    state = {"patch_embed.weight": t["visual.patch_embed.proj.weight"].reshape(config.embed_dim, -1)}
    for i in range(config.depth):
        src = f"visual.blocks.{i}."
        for ours, theirs in [
            ("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
            ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"),
        ]:  # fmt: skip
            state[f"blocks.{i}.{ours}.weight"] = t[src + theirs + ".weight"]
            state[f"blocks.{i}.{ours}.bias"] = t[src + theirs + ".bias"]
    for ours, theirs in [("norm", "ln_q"), ("fc1", "mlp.0"), ("fc2", "mlp.2")]:
        state[f"merger.{ours}.weight"] = t[f"visual.merger.{theirs}.weight"]
        state[f"merger.{ours}.bias"] = t[f"visual.merger.{theirs}.bias"]
    return state


def _text_state(t: _Tensors, config: TextConfig) -> dict[str, torch.Tensor]:
    state = {"embed.weight": t["model.embed_tokens.weight"], "norm.weight": t["model.norm.weight"]}
    head = t.get("lm_head.weight")
    state["lm_head.weight"] = state["embed.weight"] if config.tie_word_embeddings or head is None else head
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        state[dst + "attention_norm.weight"] = t[src + "input_layernorm.weight"]
        state[dst + "ffn_norm.weight"] = t[src + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            state[dst + f"attention.wqkv.{kind}"] = torch.cat([t[attn + f"{p}_proj.{kind}"] for p in "qkv"])
        state[dst + "attention.wo.weight"] = t[attn + "o_proj.weight"]
        state[dst + "feed_forward.w_gate_up.weight"] = torch.cat(
            [t[src + "mlp.gate_proj.weight"], t[src + "mlp.up_proj.weight"]]
        )
        state[dst + "feed_forward.w_down.weight"] = t[src + "mlp.down_proj.weight"]
    return state


def _cast(module: torch.nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, linear_dtype: torch.dtype):
    """Cast a state dict: weights/biases of ``nn.Linear`` layers to ``linear_dtype``, the rest to ``dtype``."""
    linears = {name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    return {k: v.to(linear_dtype if k.rpartition(".")[0] in linears else dtype) for k, v in state.items()}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    vision_linear_dtype: torch.dtype | None = None,
    lm_linear_dtype: torch.dtype | None = None,
) -> tuple[VisionEncoder, Qwen2LM]:
    """Build the vision encoder and language model with the checkpoint's weights.

    Args:
        model_dir: checkpoint directory.
        dtype: dtype of every parameter (the embedding table keeps a narrower checkpoint dtype),
            and of activations.
        vision_linear_dtype / lm_linear_dtype: dtype of the linear layers' weights where it
            differs, e.g. the checkpoint's bfloat16 for layers about to be quantized, so a float32
            copy never exists. The tied LM head is untied when its dtype differs from the
            embedding's.

    Modules are built on the meta device and take the tensors without extra copies; a tied LM head
    shares the embedding matrix when both have the same dtype.

    Raises:
        ModelLoadError: missing files or tensors, or shapes that do not match ``config.json``.
    """
    model_dir = Path(model_dir)
    try:
        text_config, vision_config = read_configs(model_dir)
        tensors = _Tensors(model_dir)
        with torch.device("meta"):
            vision, lm = VisionEncoder(vision_config), Qwen2LM(text_config)
        vision_state = _cast(vision, _vision_state(tensors, vision_config), dtype, vision_linear_dtype or dtype)
        vision.load_state_dict(vision_state, strict=True, assign=True)
        del vision_state
        raw_lm_state = _text_state(tensors, text_config)
        stored = raw_lm_state.pop("embed.weight")
        lm_state = _cast(lm, raw_lm_state, dtype, lm_linear_dtype or dtype)
        del raw_lm_state
        # The embedding table stays in the checkpoint's dtype when that is narrower: a lookup is
        # then upcast row by row (exact), and a float32 run does not hold a 0.5 GB float32 table.
        lm_state["embed.weight"] = stored if stored.dtype.itemsize < dtype.itemsize else stored.to(dtype)
        lm.load_state_dict(lm_state, strict=True, assign=True)
    except (KeyError, RuntimeError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model_dir} into the fast engine: {exc}") from exc
    if text_config.tie_word_embeddings and lm.lm_head.weight.dtype == lm.embed.weight.dtype:
        lm.lm_head.weight = lm.embed.weight
    return vision.eval(), lm.eval()
