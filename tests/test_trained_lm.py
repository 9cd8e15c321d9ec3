"""Numerics on the trained-LM fixture: a slice of the real-text fidelity run, its thresholds asserted.

The fixture is a full-size checkpoint whose language model is Qwen2.5-Coder-0.5B-Instruct
(``benchmarks/trained_lm.py`` makes it; about 2.3 GB, so it is never made by the tests): set
``MINERU_FAST_TRAINED_LM`` to its folder. Without it, or without the workload beside the clone,
the tests skip with the reason. With ``MINERU_FAST_LLAMACPP_TOOLS`` set to a folder (where
``bench.llamacpp.ensure_tools`` installs llama.cpp's tools: network on first use) the slice also
measures llama.cpp's Q8_0 row.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import WORKLOAD, need
from stepping import stepped_generate

from mineru_fast.bench.fidelity import LLAMA_CPP_ROW, PER_CHANNEL, run_content
from mineru_fast.runtime.hub import lm_source

# Five full-size engines one after another, and llama.cpp's row when asked for: about 10 minutes
# on 2 cores, past the suite's 600 s per test (the module's fixture runs inside its first test).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIGS = {
    "fast": {"preset": "fast", "overrides": {}},  # the LM on 32-value blocks
    "bf16": {"preset": "bf16", "overrides": {}},
    "per_channel": {"preset": "fast", "overrides": {**PER_CHANNEL, "int8_kernel": "onednn"}},
    "torch_ao": {"preset": "fast", "overrides": {**PER_CHANNEL, "int8_kernel": "torch_ao"}},
}


@pytest.fixture(scope="module")
def slice_run() -> dict:
    folder = os.environ.get("MINERU_FAST_TRAINED_LM")
    if not folder:
        pytest.skip("MINERU_FAST_TRAINED_LM is not set (the trained-LM checkpoint of benchmarks/trained_lm.py)")
    if lm_source(Path(folder)) is None:
        pytest.skip(f"{folder} is not a checkpoint with a trained language model (no LM_SOURCE.json)")
    spec = {"model": folder, "threads": None, "workload": str(need(WORKLOAD)), "forced_steps": 100,
            "free_blocks": 1, "configs": CONFIGS}  # fmt: skip
    if os.environ.get("MINERU_FAST_LLAMACPP_TOOLS"):
        spec["llama_cpp"] = {"tools": os.environ["MINERU_FAST_LLAMACPP_TOOLS"]}
    return run_content(spec)


def test_fast_preset_meets_the_acceptance_thresholds(slice_run):
    """On a slice (~300 forced steps, 3 free blocks), what the full run measured (943 steps,
    benchmarks/README.md): the fast preset agrees with fp32 on >= 99.5 % of the confident steps
    (full run: 493 of 493), over all steps no less than bf16 (full run: 98.62 % against 98.52 %;
    one step of a slice is ~0.3 %, so one step of slack), and its free-running outputs equal
    fp32's on at least as many blocks as bf16's (12 of 12 each in the full run)."""
    results = slice_run["results"]
    fast, bf16 = results["fast"], results["bf16"]
    assert slice_run["forced"]["steps"] > 250 and fast["forced"]["groups"]["confident"]["steps"] > 50
    # 99.5 % of the slice's ~160 confident steps leaves no flip at all; one step of slack keeps the
    # bound's meaning at the slice's resolution.
    confident = fast["forced"]["groups"]["confident"]
    flips = round(confident["steps"] * (1 - confident["top1_pct"] / 100))
    assert flips <= int(0.005 * confident["steps"]) + 1
    one_step = 100 / slice_run["forced"]["steps"]
    assert fast["forced"]["groups"]["all"]["top1_pct"] >= bf16["forced"]["groups"]["all"]["top1_pct"] - one_step
    assert fast["free"]["all"]["identical"] >= bf16["free"]["all"]["identical"]
    assert fast["forced"]["groups"]["all"]["mean_cosine"] >= 0.9995


def test_32_value_blocks_close_most_of_per_channels_gap(slice_run):
    """Per channel / per token INT8 (the fast preset's LM before) flips near-ties where fp32 is
    unsure: full run 94.27 % over all steps against the blocks' 98.62 %. On the slice the blocks
    agree on more steps, by at least a third of that gap."""
    groups = {label: r["forced"]["groups"] for label, r in slice_run["results"].items()}
    assert groups["fast"]["all"]["top1_pct"] >= groups["per_channel"]["all"]["top1_pct"] + 1.5
    assert groups["fast"]["all"]["mean_cosine"] > groups["per_channel"]["all"]["mean_cosine"]


def test_the_fixture_separates_per_tensor_from_per_token(slice_run):
    """One activation scale over a whole sequence (per tensor) loses many greedy choices that
    per-token scales keep: the trained LM discriminates where random weights could not."""
    groups = {label: r["forced"]["groups"] for label, r in slice_run["results"].items()}
    assert groups["torch_ao"]["all"]["top1_pct"] < groups["per_channel"]["all"]["top1_pct"] - 10
    assert groups["torch_ao"]["confident"]["top1_pct"] < groups["per_channel"]["confident"]["top1_pct"]


def test_llama_cpp_q8_0_row(slice_run):
    """llama.cpp's Q8_0 (32-value blocks, each with its own scale, for weights and activations
    alike) on the same weights: every forced step but a few that cannot be asked (a prefix ending
    inside a UTF-8 character) is compared; it agrees with fp32 on the confident steps, and over all
    steps it is within a slice's noise of bf16 (full run: benchmarks/README.md)."""
    row = slice_run[LLAMA_CPP_ROW]
    if not os.environ.get("MINERU_FAST_LLAMACPP_TOOLS"):
        assert row == {"skipped": "not asked for (spec key llama_cpp)"}
        pytest.skip("MINERU_FAST_LLAMACPP_TOOLS is not set (a folder for llama.cpp's tools)")
    groups, steps = row["forced"]["groups"], slice_run["forced"]["steps"]
    not_asked = row["forced"]["steps_not_asked"]
    assert not_asked <= 0.02 * steps and groups["all"]["steps"] + not_asked == steps
    assert groups["confident"]["top1_pct"] >= 99.5 and groups["all"]["mean_cosine"] is None
    bf16 = slice_run["results"]["bf16"]["forced"]["groups"]["all"]["top1_pct"]
    assert groups["all"]["top1_pct"] >= bf16 - 3
    assert row["free"]["all"]["blocks"] + len(row["free"]["not_decided"]) == slice_run["free"]["blocks"]


def test_every_block_path_gives_the_same_forced_logits(monkeypatch):
    """The fast preset's language model on the trained LM's forced steps (the workload's content
    blocks, ground-truth text forced): the own kernel's path chosen here, each lower path this CPU
    runs and the PyTorch form (compiled kernels off) give the same logits, bit for bit, so the same
    tokens whichever runs."""
    from mineru_fast import ParserOptions
    from mineru_fast.bench.fidelity import content_requests, forced_logits_prefill
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.engine import kernels
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.preprocess import Preprocessor

    folder = os.environ.get("MINERU_FAST_TRAINED_LM")
    if not folder:
        pytest.skip("MINERU_FAST_TRAINED_LM is not set (the trained-LM checkpoint of benchmarks/trained_lm.py)")
    model = Path(folder)
    counter = Preprocessor(model)
    pages = load_workload(None, need(WORKLOAD))
    forced, _ = content_requests(pages, ParserOptions(), lambda t: len(counter.forced_ids(t)), 40, 0)
    status = kernels.kernel_status()
    runs = [("chosen", {})]
    if status.path is not None:
        lower = kernels.PATHS[kernels.PATHS.index(status.path) + 1 :]
        runs += [(path, {kernels.PATH_ENV: path}) for path in lower]
    runs.append(("pytorch", {kernels.OWN_KERNELS_ENV: "0"}))
    logits: dict[str, list] = {}
    for label, env in runs:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        kernels.kernel_status.cache_clear()
        try:
            engine = build_engine(model, ParserOptions(threads=None), prepared_cache=False)
            try:
                assert engine.numerics["lm_int8_block"] == kernels.kernel_status().reason
                logits[label] = [forced_logits_prefill(engine, request) for _, request in forced]
            finally:
                engine.close()
        finally:
            for key in env:
                monkeypatch.delenv(key)
            kernels.kernel_status.cache_clear()
    steps = sum(len(x) for x in logits["chosen"])
    assert steps >= 100
    for label, _ in runs[1:]:
        for ours, theirs in zip(logits[label], logits["chosen"], strict=True):
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), label


def test_speculative_decoding_free_running_gives_the_plain_tokens():
    """The trained LM free-running on the workload's content blocks (text, tables, equations; the
    MinerU rules of each task on, 160 new tokens at most): speculative decoding on and off give the
    same tokens and log-probabilities, bit for bit, and some drafts were accepted (a trained model
    repeats its own n-grams, as real outputs do)."""
    from dataclasses import replace

    from mineru_fast import ParserOptions
    from mineru_fast.bench.fidelity import content_requests
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.preprocess import Preprocessor

    folder = os.environ.get("MINERU_FAST_TRAINED_LM")
    if not folder:
        pytest.skip("MINERU_FAST_TRAINED_LM is not set (the trained-LM checkpoint of benchmarks/trained_lm.py)")
    model = Path(folder)
    counter = Preprocessor(model)
    pages = load_workload(None, need(WORKLOAD))
    _, free = content_requests(pages, ParserOptions(), lambda t: len(counter.forced_ids(t)), 0, 3)
    requests = [replace(r, sampling=replace(r.sampling, max_new_tokens=160)) for _, r in free]
    # a slot per request and the loop stepped here: both runs group their prefill work alike (stepping)
    options = ParserOptions.preset("fast", threads=None, slots=len(requests))
    engine = build_engine(model, options, prepared_cache=False)
    try:
        plain = stepped_generate(engine, requests)
        drafted = stepped_generate(engine, [replace(r, speculative=6) for r in requests])
    finally:
        engine.close()
    for off, on in zip(plain, drafted, strict=True):
        assert (on.token_ids, on.logprobs, on.finish_reason) == (off.token_ids, off.logprobs, off.finish_reason)
    assert sum(r.accepted_tokens for r in drafted) > 0
