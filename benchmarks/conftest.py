"""Fixtures of the pytest-benchmark microbenchmarks (tiny synthetic model; run with --benchmark-only)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory):
    from mineru_fast.engine.generate import FastEngine
    from mineru_fast.engine.synthetic import make_synthetic_model

    return FastEngine(
        make_synthetic_model(tmp_path_factory.mktemp("m") / "tiny", "tiny"), "fp32", slots=16, max_seq_len=4096
    )
