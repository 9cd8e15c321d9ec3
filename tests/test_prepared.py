"""The prepared-model cache: reuse, invalidation, a truncated entry, concurrent writers, bypass."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from samples import text_page
from test_fast_engine import page_requests
from torch import nn

from mineru_fast import ParserOptions
from mineru_fast.engine.factory import build_engine
from mineru_fast.engine.generate import FastEngine
from mineru_fast.engine.prepared import MANIFEST, PreparedCache, cacheable, prepared_settings
from mineru_fast.engine.quantize import (
    Bf16WeightsConfig,
    Bf16WeightsLinear,
    BlockInt8Linear,
    GemvInt8Linear,
    Int8BlockConfig,
    Int8DynamicConfig,
    Int8WeightOnlyConfig,
    Int8WeightOnlyLinear,
    IntMmInt8Linear,
    OneDnnInt8Linear,
)
from mineru_fast.engine.vision import qkv_row_groups
from mineru_fast.runtime.hub import PREPARED_CACHE_ENV as CACHE_ENV

INT8 = Int8DynamicConfig()


def make_engine(model: Path, root: Path | None, **quant: object) -> FastEngine:
    configs = {"vision_quant": INT8, "lm_quant": INT8, "lm_head_quant": INT8, **quant}
    return FastEngine(model, precision="fp32", slots=4, max_seq_len=2048, prepared_cache=root, **configs)


def outputs(engine: FastEngine) -> list[tuple[list[int], list[float]]]:
    """Tokens and log-probabilities of a page's layout request and three crops, greedy."""
    try:
        results = engine.generate(page_requests(text_page()))
    finally:
        engine.close()
    return [(r.token_ids, r.logprobs) for r in results]


def entries(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))


@pytest.fixture(scope="module")
def uncached(tiny_model: Path) -> list[tuple[list[int], list[float]]]:
    return outputs(make_engine(tiny_model, None))


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model (tests change its files' times)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def test_warm_start_reads_the_entry_and_decodes_the_same_tokens(model, tmp_path, uncached):
    root = tmp_path / "prepared"
    cold = make_engine(model, root)
    assert cold.prepared_from == "checkpoint" and len(entries(root)) == 1
    assert outputs(cold) == uncached  # the embedding now read from the entry's memory map
    warm = make_engine(model, root)
    assert warm.prepared_from == "cache"
    assert isinstance(warm.lm.layers[0].attention.wqkv, OneDnnInt8Linear)
    for engine in (cold, warm):  # the vision attention's qkv packed by head group, also as read back
        qkv = engine.vision.blocks[0].qkv
        assert isinstance(qkv, OneDnnInt8Linear) and qkv.row_groups is not None
        assert torch.equal(qkv.row_groups, qkv_row_groups(engine.vision.config))
    assert outputs(warm) == uncached  # same tokens and the same log-probabilities, bit for bit
    assert not list(root.glob(".tmp-*")) and not list(root.glob(".trash-*"))


@pytest.mark.slow  # several engine builds: ~10 s under load
def test_a_changed_checkpoint_or_setting_gets_a_new_entry_and_the_stale_one_goes(model, tmp_path):
    root = tmp_path / "prepared"
    make_engine(model, root).close()
    (first,) = entries(root)
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new file in its place
    changed = make_engine(model, root)
    changed.close()
    assert changed.prepared_from == "checkpoint"
    (second,) = entries(root)  # the entry of the old file is gone: it can never be used again
    assert second != first
    other = make_engine(model, root, lm_head_quant=None)  # other settings: their own entry
    other.close()
    assert other.prepared_from == "checkpoint" and second in entries(root) and len(entries(root)) == 2
    assert make_engine(model, root, lm_head_quant=None).prepared_from == "cache"


@pytest.mark.slow  # several engine builds: ~10 s under load
def test_a_truncated_entry_is_discarded_and_prepared_again(model, tmp_path, uncached, caplog):
    root = tmp_path / "prepared"
    make_engine(model, root).close()
    (entry,) = entries(root)
    layer_file = entry / "lm.layers.0.feed_forward.w_gate_up.safetensors"
    layer_file.write_bytes(layer_file.read_bytes()[: layer_file.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="mineru_fast.engine.generate"):
        again = make_engine(model, root)
    assert again.prepared_from == "checkpoint"
    assert any("cannot be read" in r.getMessage() for r in caplog.records)
    assert outputs(again) == uncached
    assert make_engine(model, root).prepared_from == "cache"  # committed anew, whole


def test_of_two_writers_of_one_entry_one_commits_and_the_other_drops_its_copy(model, tmp_path):
    root = tmp_path / "prepared"
    first = make_engine(model, None)
    first.close()
    cache = PreparedCache(root, model, prepared_settings(torch.float32, {"vision": INT8, "lm": INT8, "lm_head": INT8}))
    writers = [cache.writer(), cache.writer()]
    for writer in writers:  # both prepared the model at the same time
        for part, module in (("vision", first.vision), ("lm", first.lm)):
            for name, layer in module.named_modules():
                if isinstance(layer, OneDnnInt8Linear):
                    writer.add(part, name, layer)
    assert [w.commit(first.vision, first.lm) for w in writers] == [True, False]
    assert entries(root) == [cache.path] and not list(root.glob(".tmp-*"))
    assert make_engine(model, root).prepared_from == "cache"


@pytest.mark.slow  # several engine builds: ~10 s under load
def test_the_environment_variable_and_the_flag_bypass_the_cache(model, tmp_path, monkeypatch):
    monkeypatch.setenv("MINERU_FAST_CACHE", str(tmp_path / "cache"))
    options = ParserOptions(threads=1, slots=2, max_seq_len=2048)
    monkeypatch.setenv(CACHE_ENV, "off")
    build_engine(model, options).close()
    assert not (tmp_path / "cache" / "prepared").exists()
    monkeypatch.delenv(CACHE_ENV)
    build_engine(model, options, prepared_cache=False).close()
    assert not (tmp_path / "cache" / "prepared").exists()
    engine = build_engine(model, options)
    engine.close()
    assert len(entries(tmp_path / "cache" / "prepared")) == 1
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))  # a folder moves the cache
    build_engine(model, options).close()
    assert len(entries(tmp_path / "elsewhere")) == 1
    from mineru_fast.cli.main import build_argparser

    assert build_argparser().parse_args(["serve", "--no-prepared-cache"]).no_prepared_cache


def test_only_int8_models_without_torch_ao_are_cached():
    assert cacheable([INT8, None, None]) and cacheable([Int8WeightOnlyConfig(), None, None])
    assert cacheable([None, Int8BlockConfig(), Int8BlockConfig()])
    assert not cacheable([Bf16WeightsConfig(), Bf16WeightsConfig(), None])  # the checkpoint is the prepared form
    assert not cacheable([Int8DynamicConfig("torch_ao"), INT8, INT8])


@pytest.mark.parametrize(
    "kind",
    [OneDnnInt8Linear, GemvInt8Linear, IntMmInt8Linear, BlockInt8Linear, Int8WeightOnlyLinear, Bf16WeightsLinear],
)
@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_rebuilt_from_its_prepared_state_gives_the_same_outputs(kind, bias):
    torch.manual_seed(0)
    layer = kind(nn.Linear(96, 40, bias=bias))
    rebuilt = kind.from_prepared({k: v.clone() for k, v in layer.prepared_state().items()})
    x = torch.randn(7, 96)
    assert (rebuilt.in_features, rebuilt.out_features) == (96, 40)
    assert torch.equal(rebuilt(x), layer(x))


@pytest.mark.slow  # several engine builds: ~10 s under load
def test_a_float_head_tied_to_the_embedding_stays_tied_cold_and_warm(model, tmp_path):
    root = tmp_path / "prepared"
    float_head = {"lm_head_quant": None}
    expected = outputs(make_engine(model, None, **float_head))
    for source in ("checkpoint", "cache"):
        engine = make_engine(model, root, **float_head)
        assert engine.prepared_from == source and engine.lm.lm_head.weight is engine.lm.embed.weight
        weights = engine.memory_report()["weights"]
        assert not [k for k in weights if k.startswith("lm head")]  # counted once, as the embedding
        assert outputs(engine) == expected


def test_a_cache_that_cannot_be_written_leaves_the_load_whole_and_no_folder(model, tmp_path, monkeypatch, uncached):
    from safetensors import SafetensorError

    import mineru_fast.engine.prepared as prepared

    def full_disk(*_args, **_kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(prepared, "save_file", full_disk)
    root = tmp_path / "prepared"
    engine = make_engine(model, root)
    assert engine.prepared_from == "checkpoint" and not engine.cache_committed
    assert outputs(engine) == uncached
    assert not entries(root) and not list(root.glob(".tmp-*"))


def test_leftovers_of_killed_writers_are_swept_and_other_environments_entries_kept(model, tmp_path):
    import json

    root = tmp_path / "prepared"
    old_tmp, trash, fresh_tmp = root / ".tmp-abc-1-x", root / ".trash-abc-y", root / ".tmp-def-2-z"
    for folder in (old_tmp, trash, fresh_tmp):
        (folder / "part").mkdir(parents=True)
    os.utime(old_tmp, (0, 0))  # untouched for decades: a writer killed long ago
    elsewhere = root / "other-torch"  # the same checkpoint and settings prepared by another torch
    elsewhere.mkdir()
    engine = make_engine(model, root)
    engine.close()
    identity = json.loads((engine_entry := entries(root)[0]).joinpath(MANIFEST).read_text())["identity"]
    (elsewhere / MANIFEST).write_text(json.dumps({"format": 1, "identity": {**identity, "torch": "0.0"}}))
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    make_engine(model, root).close()  # a new file: this environment's old entry is stale, the other's is not
    assert not old_tmp.exists() and not trash.exists() and fresh_tmp.exists()
    assert elsewhere in entries(root) and engine_entry not in entries(root) and len(entries(root)) == 2


def _flip_weights(entry: Path) -> str:
    """4,096 bytes of a packed LM weight set to 0x7f (the audit's case: it loaded without a word)."""
    name = "lm.layers.0.attention.wqkv.safetensors"
    data = bytearray((entry / name).read_bytes())
    data[-8192:-4096] = b"\x7f" * 4096
    (entry / name).write_bytes(bytes(data))
    return name


def _swap_header_dtype(entry: Path) -> str:
    """A dtype in a file's header changed to another of the same size (I8 -> U8): every request of
    every later start failed on 44d1b50, the entry being kept."""
    name = "lm.layers.0.feed_forward.w_gate_up.safetensors"
    data = (entry / name).read_bytes()
    assert b'"dtype":"I8"' in data[:4096]
    (entry / name).write_bytes(data.replace(b'"dtype":"I8"', b'"dtype":"U8"', 1))
    return name


def _flip_shape(entry: Path) -> str:
    """A byte of a tensor's shape in a file's header flipped (the issue's case: every page of every
    later parse failed, "n_size and weight disagree on N", until the folder was removed by hand)."""
    name = "lm.layers.0.attention.wqkv.safetensors"
    data = bytearray((entry / name).read_bytes())
    at = data.index(b'"shape":[') + len(b'"shape":[')
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    (entry / name).write_bytes(bytes(data))
    return name


def _zero_embedding(entry: Path) -> str:
    """The embedding table's bytes zeroed (the non-linear tensors' file)."""
    name = "lm.safetensors"
    data = bytearray((entry / name).read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)
    (entry / name).write_bytes(bytes(data))
    return name


@pytest.mark.parametrize(
    "damage",
    [
        _flip_weights,
        pytest.param(_swap_header_dtype, marks=pytest.mark.slow),
        pytest.param(_flip_shape, marks=pytest.mark.slow),
        pytest.param(_zero_embedding, marks=pytest.mark.slow),
    ],
)
def test_a_damaged_entry_is_detected_by_its_digests_and_prepared_again(model, tmp_path, uncached, caplog, damage):
    """Audit round 4, N4: a damaged entry loaded as valid weights (other tokens) or failed every
    request of every later start. Its files' digests now tell, the warning names the file, and the
    model is prepared again: the same tokens as without a cache."""
    root = tmp_path / "prepared"
    make_engine(model, root).close()
    (entry,) = entries(root)
    name = damage(entry)
    with caplog.at_level(logging.WARNING, logger="mineru_fast.engine.generate"):
        again = make_engine(model, root)
    assert again.prepared_from == "checkpoint"
    warned = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0]
    assert outputs(again) == uncached
    assert make_engine(model, root).prepared_from == "cache"  # committed anew, whole


@pytest.mark.slow  # several engine builds: ~10 s under load
def test_an_entry_of_another_key_or_an_old_format_is_not_used_and_old_formats_go(model, tmp_path, uncached):
    """An entry copied under this key's name from other settings is refused (its manifest's
    identity is not this key's) and prepared again; committing removes this checkpoint's entries
    of older formats in the same environment (they piled up, 1.4 GB each)."""
    import json

    root = tmp_path / "prepared"
    make_engine(model, root, lm_head_quant=None).close()
    (other,) = entries(root)
    mine = PreparedCache(root, model, prepared_settings(torch.float32, {"vision": INT8, "lm": INT8, "lm_head": INT8}))
    shutil.copytree(other, mine.path)
    old_format = root / "old-format"
    shutil.copytree(other, old_format)
    manifest = json.loads((old_format / MANIFEST).read_text())
    manifest["format"] = manifest["identity"]["format"] = 3
    manifest["identity"]["settings"] = mine.identity["settings"]
    (old_format / MANIFEST).write_text(json.dumps(manifest))
    engine = make_engine(model, root)
    assert engine.prepared_from == "checkpoint" and outputs(engine) == uncached
    assert json.loads((mine.path / MANIFEST).read_text())["identity"] == mine.identity  # this key's, anew
    assert not old_format.exists() and other in entries(root)  # other settings: another preset's entry, kept
