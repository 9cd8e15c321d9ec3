"""Read a MinerU2.5 / Qwen2-VL checkpoint directory into the fast engine's modules.

The Hugging Face tensor names are mapped once at load; q/k/v and gate/up are concatenated into
the fused projections; the 3-D patch convolution (kernel = stride) becomes a linear layer.
Tensors are read one at a time, and each linear layer can be prepared (quantized) as soon as its
weights are read, so loading never holds the whole checkpoint beside the prepared model.
Both the published layout (``visual.*``, ``model.layers.*``) and transformers 5's
(``model.visual.*``, ``model.language_model.*``) are accepted.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn

from mineru_fast.engine.memory import trim_heap
from mineru_fast.engine.model import Qwen2LM, TextConfig
from mineru_fast.engine.vision import VisionConfig, VisionEncoder
from mineru_fast.errors import ModelLoadError

Thunk = Callable[[], torch.Tensor]
Prepare = Callable[[str, nn.Linear], nn.Module]


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

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def thunk(self, *names: str) -> Thunk:
        """A call that reads ``names`` (concatenated along dim 0 when several) when it is made.

        Raises:
            KeyError: a name is not in the checkpoint (at once, not when called).
        """
        for name in names:
            if name not in self._where:
                raise KeyError(name)
        if len(names) == 1:
            return lambda: self[names[0]]
        return lambda: torch.cat([self[name] for name in names])


def _vision_state(t: _Tensors, config: VisionConfig) -> dict[str, Thunk]:
    def patch_embed() -> torch.Tensor:
        return t["visual.patch_embed.proj.weight"].reshape(config.embed_dim, -1)

    state: dict[str, Thunk] = {"patch_embed.weight": patch_embed}
    for i in range(config.depth):
        src = f"visual.blocks.{i}."
        for ours, theirs in [
            ("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
            ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"),
        ]:  # fmt: skip
            state[f"blocks.{i}.{ours}.weight"] = t.thunk(src + theirs + ".weight")
            state[f"blocks.{i}.{ours}.bias"] = t.thunk(src + theirs + ".bias")
    for ours, theirs in [("norm", "ln_q"), ("fc1", "mlp.0"), ("fc2", "mlp.2")]:
        state[f"merger.{ours}.weight"] = t.thunk(f"visual.merger.{theirs}.weight")
        state[f"merger.{ours}.bias"] = t.thunk(f"visual.merger.{theirs}.bias")
    return state


def _text_state(t: _Tensors, config: TextConfig) -> dict[str, Thunk]:
    state: dict[str, Thunk] = {"embed.weight": t.thunk("model.embed_tokens.weight")}
    state["norm.weight"] = t.thunk("model.norm.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in t
    state["lm_head.weight"] = t.thunk("model.embed_tokens.weight" if tied else "lm_head.weight")  # see load_model
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        state[dst + "attention_norm.weight"] = t.thunk(src + "input_layernorm.weight")
        state[dst + "ffn_norm.weight"] = t.thunk(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            state[dst + f"attention.wqkv.{kind}"] = t.thunk(*(attn + f"{p}_proj.{kind}" for p in "qkv"))
        state[dst + "attention.wo.weight"] = t.thunk(attn + "o_proj.weight")
        state[dst + "feed_forward.w_gate_up.weight"] = t.thunk(src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight")
        state[dst + "feed_forward.w_down.weight"] = t.thunk(src + "mlp.down_proj.weight")
    return state


def _materialize(
    module: nn.Module,
    state: dict[str, Thunk],
    dtype: torch.dtype,
    prepare: Prepare | None,
    tied: dict[str, str] | None = None,
) -> None:
    """Give the meta-device ``module`` its tensors, reading them one at a time.

    Non-linear parameters come first, cast to ``dtype`` (a narrower stored embedding table keeps its
    dtype). Then each ``nn.Linear`` takes its stored tensors and is handed at once to
    ``prepare(name, linear)``, whose result replaces it (None: cast to ``dtype``), so at most one
    layer's stored weights are alive beside the prepared model. ``tied`` maps a linear's tensor to
    a non-linear one it shares (the tied LM head takes the embedding table already read, not a
    second read of it).

    Raises:
        RuntimeError: ``state`` and the module's parameters differ.
    """
    expected = set(module.state_dict())
    if expected != set(state):
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(f"state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Largest first: the transient copies of preparing a layer then come while little else is
    # resident (the tied LM head's: its 0.27 GB bfloat16 source plus int8 forms, ~0.7 GB).
    linears = sorted(
        (name for name, m in module.named_modules() if isinstance(m, nn.Linear)),
        key=lambda name: -cast(nn.Linear, module.get_submodule(name)).weight.numel(),
    )
    in_linears = {f"{name}.{kind}" for name in linears for kind in ("weight", "bias")}
    rest = {}
    for key in [k for k in state if k not in in_linears]:
        stored = state.pop(key)()
        # The embedding table stays in the checkpoint's dtype when that is narrower: a lookup is
        # then upcast row by row (exact), and a float32 run does not hold a 0.5 GB float32 table.
        rest[key] = stored if key == "embed.weight" and stored.dtype.itemsize < dtype.itemsize else stored.to(dtype)
    module.load_state_dict(rest, strict=False, assign=True)
    del rest
    for name in linears:
        linear = cast(nn.Linear, module.get_submodule(name))
        own = {}
        for kind in ("weight", "bias"):
            key = f"{name}.{kind}"
            if key in state:
                own[kind] = module.get_parameter(tied[key]) if tied and key in tied else state[key]()
        linear.load_state_dict(own, strict=True, assign=True)
        del own
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, prepare(name, linear) if prepare is not None else linear.to(dtype))
        del linear
        trim_heap()  # the stored weights just freed go back to the OS: peak RSS stays near the live model


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    prepare_vision: Prepare | None = None,
    prepare_lm: Prepare | None = None,
) -> tuple[VisionEncoder, Qwen2LM]:
    """Build the vision encoder and language model with the checkpoint's weights.

    Args:
        model_dir: checkpoint directory.
        dtype: dtype of every parameter (the embedding table keeps a narrower checkpoint dtype),
            and of activations.
        prepare_vision / prepare_lm: ``prepare(name, linear) -> module`` for each ``nn.Linear``
            of the vision encoder / language model (``name`` dotted within it, e.g. ``"lm_head"``),
            called as soon as that layer's weights are read, with the weights in the checkpoint's
            dtype (e.g. to quantize it: no float32 copy of the model ever exists, and the stored
            weights of only one layer are alive at a time); the returned module takes its place.
            None: the layer is cast to ``dtype``.

    A tied LM head shares the embedding matrix when both end in the same dtype; otherwise it is
    prepared from the embedding table read once.

    Raises:
        ModelLoadError: missing files or tensors, or shapes that do not match ``config.json``.
    """
    model_dir = Path(model_dir)
    try:
        text_config, vision_config = read_configs(model_dir)
        tensors = _Tensors(model_dir)
        with torch.device("meta"):
            vision, lm = VisionEncoder(vision_config), Qwen2LM(text_config)
        tied = text_config.tie_word_embeddings or "lm_head.weight" not in tensors
        _materialize(lm, _text_state(tensors, text_config), dtype, prepare_lm,
                     {"lm_head.weight": "embed.weight"} if tied else None)  # fmt: skip
        _materialize(vision, _vision_state(tensors, vision_config), dtype, prepare_vision)  # after the LM head
    except (KeyError, RuntimeError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model_dir} into the fast engine: {exc}") from exc
    head = lm.lm_head
    if tied and isinstance(head, nn.Linear) and head.weight.dtype == lm.embed.weight.dtype:
        head.weight = lm.embed.weight  # one table for both (a float head the same dtype as the embedding)
    return vision.eval(), lm.eval()
