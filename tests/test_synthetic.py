"""Tier 2: synthetic models load in transformers like the real checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from mineru_fast.engine.synthetic import SIZES, _config, make_synthetic_model
from mineru_fast.protocol.spec import MINERU_TOKENS, QWEN2VL_SPECIAL_TOKENS, build_prompt, detect_model_version
from mineru_fast.runtime.hub import synthetic_identity


def test_full_size_has_mineru25_parameter_counts():
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**_config(SIZES["full"], "pro-2605")))
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    language = sum(p.numel() for p in model.model.language_model.parameters())
    assert 1.15e9 <= total <= 1.16e9
    assert (vision, language) == (661_993_856, 494_032_768)  # ~662 M incl. merger, ~494 M LM
    assert model.config.tie_word_embeddings


def test_tiny_model_loads_with_tied_head_and_legacy_names(tiny_model):
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert "visual.patch_embed.proj.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert "lm_head.weight" not in names
    loaded = model.model.language_model.norm.weight
    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        assert torch.equal(loaded, f.get_tensor("model.norm.weight").float())
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]


def test_tokenizer_has_qwen2_ids_and_mineru_tokens(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer.encode("你好，世界") == [108386, 3837, 99489]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN2VL_SPECIAL_TOKENS + MINERU_TOKENS]
    assert ids == list(range(151643, 151643 + len(ids)))
    assert ids[-1] < 151936  # inside the embedding table
    line = "<|box_start|>012 345 678 901<|box_end|><|ref_start|>table<|ref_end|><|rotate_up|>\n<fcel>a<nl>"
    encoded = tokenizer.encode(line)
    assert encoded[0] == 151648 and encoded.count(151659) == 1  # added tokens stay whole
    assert tokenizer.decode(encoded) == line


def test_chat_template_renders_the_protocol_prompt(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nTable Recognition:"}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == build_prompt("\nTable Recognition:")


def test_image_processor_gives_1369_tokens_for_a_layout_page(tiny_model):
    from PIL import Image

    processor = AutoImageProcessor.from_pretrained(tiny_model)
    out = processor(images=[Image.new("RGB", (1036, 1036))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 74, 74]]
    assert out["pixel_values"].shape == (74 * 74, 3 * 2 * 14 * 14)


def test_synthetic_models_follow_pro_2605_unless_told(tmp_path, tiny_model):
    """MinerU 4 runs Pro-2605: a synthetic model reports its protocol, 2509 one option away; the
    weights do not depend on the version."""
    assert detect_model_version(tiny_model) == "pro-2605"
    assert synthetic_identity(tiny_model) == "synthetic (random weights, size=tiny, seed=0, version=pro-2605)"
    old = make_synthetic_model(tmp_path / "old", "tiny", seed=0, version="2509")
    assert json.loads((old / "config.json").read_text())["_name_or_path"] == "mineru-fast/synthetic-MinerU2.5-2509-1.2B"
    assert detect_model_version(old) == "2509"
    assert (old / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="version must be one of"):
        make_synthetic_model(tmp_path / "bad", "tiny", version="2511")


def test_same_seed_same_weights_other_seed_differs(tmp_path, tiny_model):
    again = make_synthetic_model(tmp_path / "again", "tiny", seed=0)
    other = make_synthetic_model(tmp_path / "other", "tiny", seed=1)
    assert (again / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny_model / "model.safetensors").read_bytes()


def test_the_weights_get_the_mode_of_the_folders_other_files(tiny_model):
    """safetensors writes 0600 through a temporary file; a model made by one user must load for
    another (a container's user reading a mounted folder) as its config does."""
    config_mode = (tiny_model / "config.json").stat().st_mode & 0o777
    assert (tiny_model / "model.safetensors").stat().st_mode & 0o777 == config_mode
