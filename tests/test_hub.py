"""Tier 1: where models come from (local directories, a Hugging Face hub cache laid out here, the
hub flags of the CLI) and the package's own cache directory. No test reaches the network: a socket
guard turns any connection attempt into a failure."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from samples import pdf_bytes

from mineru_fast import DocumentParser, ModelInfo, ParserOptions
from mineru_fast.cli.main import main
from mineru_fast.engine.synthetic import cached_synthetic_model
from mineru_fast.errors import ModelLoadError, ModelNotCached
from mineru_fast.runtime.hub import MARKER, cache_dir, resolve_model, resolve_model_info

GOOD = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"  # snapshot with weights, ref "v1"
BROKEN = "ffffeeeeddddccccbbbbaaaa9999888877776666"  # snapshot without weights, ref "main"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a hub test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub_cache(tiny_model, tmp_path):
    """``models--org--tiny`` in huggingface_hub's cache layout: refs/v1 -> a complete snapshot,
    refs/main -> one whose weights are missing."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    good, broken = repo / "snapshots" / GOOD, repo / "snapshots" / BROKEN
    good.mkdir(parents=True)
    broken.mkdir()
    for f in tiny_model.iterdir():
        (good / f.name).symlink_to(f)
    (broken / "config.json").symlink_to(tiny_model / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(BROKEN)
    (repo / "refs" / "v1").write_text(GOOD)
    return cache


def test_from_pretrained_loads_a_revision_offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / GOOD
    options = ParserOptions.preset("exact", progress=False)
    parser = DocumentParser.from_pretrained("org/tiny", options, revision="v1", cache_dir=hub_cache)
    assert parser.model_info == ModelInfo(snapshot.resolve(), "org/tiny", "v1", GOOD)
    assert parser.model_dir == snapshot.resolve()
    assert parser.model_info.to_dict() == {
        "model_id": "org/tiny",
        "revision": "v1",
        "commit": GOOD,
        "local_dir": str(snapshot.resolve()),
    }
    by_commit = resolve_model_info("org/tiny", revision=GOOD, cache_dir=hub_cache)
    assert (by_commit.commit, by_commit.revision, by_commit.local_dir) == (GOOD, GOOD, snapshot.resolve())
    # The snapshot directory passed as a path is recognised as the same checkpoint.
    assert ModelInfo.from_dir(snapshot) == ModelInfo(snapshot, "org/tiny", None, GOOD)


def test_offline_errors_say_what_is_missing_and_where(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = hub_cache / "models--org--tiny"
    with pytest.raises(ModelNotCached, match=f"{BROKEN} has no \\*.safetensors weights"):
        resolve_model_info("org/tiny", cache_dir=hub_cache)  # main's snapshot lacks its weights
    with pytest.raises(ModelNotCached) as missing_ref:
        resolve_model_info("org/tiny", revision="v2", cache_dir=hub_cache)
    assert f"no ref 'v2' in {repo / 'refs'} (cached refs: main, v1)" in str(missing_ref.value)
    assert "hf download org/tiny --revision v2" in str(missing_ref.value)
    absent = "0" * 40
    with pytest.raises(ModelNotCached, match=f"no snapshot {absent} in {repo / 'snapshots'}"):
        resolve_model_info("org/tiny", revision=absent, cache_dir=hub_cache)
    with pytest.raises(ModelNotCached, match=f"no models--org--absent folder in {hub_cache}"):
        resolve_model_info("org/absent", cache_dir=hub_cache)


def test_local_files_only_without_the_environment_flag(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelNotCached, match="no models--org--absent folder"):
        resolve_model_info("org/absent", cache_dir=hub_cache, local_files_only=True)
    assert resolve_model("org/tiny", revision="v1", cache_dir=hub_cache, local_files_only=True).name == GOOD


def test_local_directories(tiny_model, tmp_path):
    assert resolve_model(tiny_model) == tiny_model
    assert resolve_model_info(tiny_model) == ModelInfo(tiny_model)
    with pytest.raises(ModelLoadError, match="selects a hub snapshot"):
        resolve_model_info(tiny_model, revision="v1")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match="no such model directory"):
        resolve_model("./not/a/dir")


def test_version_names_stand_for_their_hub_ids(hub_cache, monkeypatch):
    """``--model 2509`` is MinerU2.5-2509's hub id (offline here: the error names the id); the
    default is mineru 4.0.12's one model."""
    from mineru_fast.runtime.hub import DEFAULT_MODEL_ID

    assert DEFAULT_MODEL_ID == "opendatalab/MinerU2.5-Pro-2605-1.2B"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotCached, match="opendatalab/MinerU2.5-2509-1.2B"):
        resolve_model("2509", cache_dir=hub_cache)
    with pytest.raises(ModelNotCached, match="opendatalab/MinerU2.5-Pro-2605-1.2B"):
        resolve_model(cache_dir=hub_cache)


def test_cli_hub_flags(hub_cache, tmp_path, capsys):
    pdf = tmp_path / "one.pdf"
    pdf.write_bytes(pdf_bytes(1))
    common = ["--model", "org/tiny", "--cache-dir", str(hub_cache), "--offline"]
    parse = ["parse", str(pdf), "-o", str(tmp_path / "out"), "--preset", "exact", "--max-new-tokens", "layout=8"]
    # it loads and runs: 8 layout tokens cut the random-weight layout, so the page says partial (1)
    assert main([*parse, *common, "--revision", "v1"]) == 1
    assert "layout output was cut (length)" in capsys.readouterr().err
    assert (tmp_path / "out" / "one" / "markdown.md").is_file()  # MinerU 4's bundle
    assert main([*parse, *common, "--revision", "v2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no ref 'v2'" in err[0]
    # serve and bench resolve the flags before anything starts.
    assert main(["serve", *common, "--revision", "v2"]) == 2
    assert "no ref 'v2'" in capsys.readouterr().err
    assert main(["bench", "--revision", "v1"]) == 2
    assert "apply to a hub id given with --model" in capsys.readouterr().err


def test_package_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("MINERU_FAST_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mineru-fast"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mineru-fast"
    monkeypatch.setenv("MINERU_FAST_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    made = cached_synthetic_model("tiny", seed=3)
    assert made == tmp_path / "mine" / "synthetic-tiny-seed3" and (made / MARKER).is_file()


def test_no_other_module_spells_the_cache_path():
    root = Path(__file__).resolve().parents[1]
    spelled = [
        str(path.relative_to(root))
        for folder in ("mineru_fast", "benchmarks", "scripts")
        for path in (root / folder).rglob("*.py")
        if '".cache"' in path.read_text(encoding="utf-8") and path.name != "hub.py"
    ]
    assert spelled == []
