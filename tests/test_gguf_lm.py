"""A trained language model from a GGUF in a synthetic checkpoint's LM slots (gguf_lm, synth-model --lm-gguf)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mineru_fast.engine.gguf_lm import GGUF_NAMES, read_gguf_lm
from mineru_fast.engine.synthetic import SIZES, _bpe_vocabulary, _config, make_synthetic_model
from mineru_fast.errors import GgufError
from mineru_fast.protocol.spec import DEFAULT_MODEL_VERSION
from mineru_fast.runtime.hub import lm_source, synthetic_identity

gguf = pytest.importorskip("gguf", reason="the gguf package (dev extra) writes and reads the test GGUF files")


def write_gguf(path: Path, source: Path, *, layers: int | None = None, untied: bool = False) -> dict[str, np.ndarray]:
    """A qwen2 GGUF of the tiny size from ``source``'s LM tensors (published names), linears as Q8_0,
    norms and biases F32; ``token_embd`` Q8_0 and ``output`` F32 of the same matrix (``untied``:
    another one). Returns the float32 values each published name should get."""
    config = _config(SIZES["tiny"], DEFAULT_MODEL_VERSION)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("test qwen2")
    writer.add_block_count(layers or config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocabulary = _bpe_vocabulary()
    writer.add_token_list(vocabulary + [f"[PAD{i}]" for i in range(len(vocabulary), config["vocab_size"])])
    expected = {}
    with safe_open(source / "model.safetensors", "pt") as f:
        published = {name: f.get_tensor(name).float().numpy() for name in f.keys() if name.startswith("model.")}
    for ours, theirs in GGUF_NAMES.items():
        for i in range(config["num_hidden_layers"]) if "{i}" in ours else [None]:
            name, values = ours.format(i=i), published[ours.format(i=i)]
            if values.ndim == 2:
                quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(theirs.format(i=i), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                expected[name] = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(theirs.format(i=i), values)
                expected[name] = values
    table = published["model.embed_tokens.weight"]
    output = np.random.default_rng(0).standard_normal(table.shape).astype(np.float32) if untied else table
    writer.add_tensor("output.weight", output)
    expected["model.embed_tokens.weight"] = output  # F32 beats token_embd's Q8_0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("gguf")
    source = make_synthetic_model(folder / "source", size="tiny", seed=1)  # an LM unlike seed 0's
    path = folder / "tiny-qwen2.gguf"
    return path, write_gguf(path, source)


def test_names_are_the_gguf_packages_qwen2_names():
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 2)
    for ours, theirs in GGUF_NAMES.items():
        published = ours.format(i=1)
        stem, _, suffix = published.rpartition(".")
        assert f"{names.get_name(stem)}.{suffix}" == theirs.format(i=1)
    assert names.get_name("lm_head") == "output"


def test_lm_slots_take_the_gguf_and_vision_stays_the_seeds(tiny_gguf, tiny_model, tmp_path):
    path, expected = tiny_gguf
    out = make_synthetic_model(tmp_path / "trained", size="tiny", seed=0, lm_gguf=path)
    with safe_open(out / "model.safetensors", "pt") as got, safe_open(tiny_model / "model.safetensors", "pt") as plain:
        assert set(got.keys()) == set(plain.keys())
        for name in got.keys():
            if name.startswith("visual."):
                assert torch.equal(got.get_tensor(name), plain.get_tensor(name)), name
            else:
                want = torch.from_numpy(expected[name]).to(torch.bfloat16)
                assert torch.equal(got.get_tensor(name), want), name
    source = lm_source(out)
    assert source is not None and source["gguf_name"] == "test qwen2" and source["size_bytes"] == path.stat().st_size
    assert source["head"].startswith("tied: output.weight (F32)")
    assert (
        synthetic_identity(out)
        == "synthetic vision (random weights, size=tiny, seed=0, version=pro-2605) + trained LM 'test qwen2' "
        "(tiny-qwen2.gguf)"
    )
    assert lm_source(tiny_model) is None


def test_cli_writes_the_trained_lm_model(tiny_gguf, tmp_path, capsys):
    from mineru_fast.cli.main import main

    path, _ = tiny_gguf
    assert main(["synth-model", str(tmp_path / "m"), "--size", "tiny", "--lm-gguf", str(path)]) == 0
    assert "with the language model of tiny-qwen2.gguf" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "LM_SOURCE.json").read_text())["gguf_file"] == "tiny-qwen2.gguf"


def test_untied_matrices_are_refused(tmp_path, tiny_model):
    path = tmp_path / "untied.gguf"
    write_gguf(path, tiny_model, untied=True)
    with pytest.raises(GgufError, match="two matrices"):
        read_gguf_lm(path, _config(SIZES["tiny"], DEFAULT_MODEL_VERSION), _bpe_vocabulary())


def test_other_shapes_and_files_are_refused(tmp_path, tiny_model):
    path = tmp_path / "deeper.gguf"
    write_gguf(path, tiny_model, layers=3)
    with pytest.raises(GgufError, match="block_count is 3, the checkpoint's num_hidden_layers is 2"):
        read_gguf_lm(path, _config(SIZES["tiny"], DEFAULT_MODEL_VERSION))
    with pytest.raises(GgufError, match="block_count is 3, the checkpoint's num_hidden_layers is 24"):
        make_synthetic_model(tmp_path / "full", size="full", lm_gguf=path)
    assert not (tmp_path / "full").exists()  # the GGUF is read before anything is written
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GgufError, match="cannot read junk.gguf"):
        read_gguf_lm(tmp_path / "junk.gguf", _config(SIZES["tiny"], DEFAULT_MODEL_VERSION))


def test_the_vocabulary_must_be_the_tokenizers(tiny_gguf):
    path, _ = tiny_gguf
    vocabulary = _bpe_vocabulary()
    vocabulary[5] = "not-this"
    with pytest.raises(GgufError, match="differs from the checkpoint's tokenizer at id 5"):
        read_gguf_lm(path, _config(SIZES["tiny"], DEFAULT_MODEL_VERSION), vocabulary)


def test_missing_gguf_package_is_a_typed_error(tiny_gguf, monkeypatch):
    path, _ = tiny_gguf
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(GgufError, match="needs the gguf package: pip install gguf"):
        read_gguf_lm(path, _config(SIZES["tiny"], DEFAULT_MODEL_VERSION))
