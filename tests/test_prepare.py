"""``mineru-fast prepare``: the prepared-model cache written ahead of time, under the key that
``parse`` and ``serve`` look up with the same flags."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mineru_fast.cli.main import build_argparser, main
from mineru_fast.cli.options import options_from_args
from mineru_fast.engine.prepared import MANIFEST
from mineru_fast.pipeline.parser import DocumentParser
from mineru_fast.runtime.hub import PREPARED_CACHE_ENV

FLAGS = ["--preset", "fast", "--threads", "1"]  # INT8: what the cache holds


@pytest.fixture(autouse=True)
def environment(monkeypatch, tmp_path) -> Path:
    """The cache in a folder of this test; the variables the command exports (threads) undone after."""
    saved = dict(os.environ)
    root = tmp_path / "prepared"
    monkeypatch.setenv(PREPARED_CACHE_ENV, str(root))
    yield root
    os.environ.clear()
    os.environ.update(saved)


def entries(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))


def test_prepare_writes_the_entry_that_parse_and_serve_then_read(tiny_model, environment, capsys):
    root = environment
    model = ["--model", str(tiny_model)]
    assert main(["prepare", *model, *FLAGS]) == 0
    [entry] = entries(root)
    out = capsys.readouterr().out
    assert re.fullmatch(
        rf"prepared model of {tiny_model.name}: written now to {re.escape(str(entry))} \([\d.]+ s\)\n", out
    )

    # parse's and serve's options from the same flags: their engines read the entry, and write nothing
    parse_args = build_argparser().parse_args(["parse", "in.pdf", "-o", "out", *model, *FLAGS])
    from mineru_fast.cli.serve import config_from_args

    serve_config = config_from_args(build_argparser().parse_args(["serve", *model, *FLAGS]))
    for options in (
        options_from_args(parse_args, progress=False, max_pages=parse_args.max_pages),
        serve_config.options,
    ):
        with DocumentParser.from_pretrained(str(tiny_model), options) as parser:
            assert parser.engine.prepared_from == "cache" and not parser.engine.cache_committed
    assert entries(root) == [entry]

    assert main(["prepare", *model, *FLAGS]) == 0
    assert capsys.readouterr().out == f"prepared model of {tiny_model.name}: already present in {entry}\n"
    assert entries(root) == [entry]


def test_prepare_refuses_a_cache_that_is_off_a_missing_model_and_an_unwritable_folder(
    tiny_model, environment, monkeypatch, tmp_path, capsys
):
    model = ["--model", str(tiny_model)]
    assert main(["prepare", *model, *FLAGS, "--no-prepared-cache"]) == 2
    assert "--no-prepared-cache" in capsys.readouterr().err
    monkeypatch.setenv(PREPARED_CACHE_ENV, "off")
    assert main(["prepare", *model, *FLAGS]) == 2
    assert f"{PREPARED_CACHE_ENV}=off" in capsys.readouterr().err
    monkeypatch.setenv(PREPARED_CACHE_ENV, str(environment))
    assert main(["prepare", "--model", str(tmp_path / "no-model"), *FLAGS]) == 2
    assert "no-model" in capsys.readouterr().err and not environment.exists()

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(PREPARED_CACHE_ENV, str(blocked / "prepared"))
    assert main(["prepare", *model, *FLAGS]) == 4
    err = capsys.readouterr().err
    assert err.startswith("mineru-fast: error: the prepared model") and "could not be written" in err

    monkeypatch.setenv(PREPARED_CACHE_ENV, str(environment))  # float weights: nothing to cache
    assert main(["prepare", *model, "--preset", "exact", "--threads", "1"]) == 0
    assert "nothing to prepare" in capsys.readouterr().out and not entries(environment)


def test_prepare_is_listed_in_the_help():
    assert re.search(r"^\s+prepare\s+write the prepared", build_argparser().format_help(), re.M)
