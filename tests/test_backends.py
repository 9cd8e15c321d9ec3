"""Backends: choosing stock / IPEX / auto, and IPEX's outputs against stock on the tiny model.

The IPEX tests run in CI's IPEX lane (torch 2.8 + intel-extension-for-pytorch 2.8) and skip
elsewhere with the reason IPEX is unusable.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fake_machine import SPR_FLAGS, build_machine
from samples import text_page

from mineru_fast.engine import backends
from mineru_fast.engine.backends import BackendStatus, choose_backend, ipex_status, isa_tier, load_measurements
from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.factory import build_engine
from mineru_fast.engine.scheduler import SequenceState
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.spec import LayoutBlock, crop_block, layout_image, prompt_for
from mineru_fast.protocol.spec import SamplingParams as SP
from mineru_fast.runtime.cpu import read_topology

USABLE = BackendStatus(True, "2.8.0+cpu", "")
MISSING = BackendStatus(False, None, "not installed: pip install 'mineru-fast[ipex]'")
STATUS = ipex_status()
needs_ipex = pytest.mark.skipif(not STATUS.usable, reason=f"IPEX unusable: {STATUS.reason}")


@pytest.fixture
def amd(tmp_path):
    return read_topology(*build_machine(tmp_path / "amd", 1, 2), affinity={0, 1})


def entry(page_s: dict | None, int8: dict | None, vendor: str = "AuthenticAMD", tier: str = "avx512_bf16") -> dict:
    return {"cpu": "Fake CPU", "vendor": vendor, "isa_tier": tier, "page_s": page_s, "int8_linear_ms": int8}


def test_isa_tiers(tmp_path, amd):
    spr = read_topology(*build_machine(tmp_path / "spr", 1, 2, flags=SPR_FLAGS), affinity={0})
    old = read_topology(*build_machine(tmp_path / "old", 1, 2, flags="sse2 avx2"), affinity={0})
    assert (isa_tier(spr), isa_tier(amd), isa_tier(old)) == ("amx", "avx512_bf16", "avx2")


def test_stock_and_explicit_ipex(amd):
    assert choose_backend("stock", amd, USABLE, []).backend == "stock"
    chosen = choose_backend("ipex", amd, USABLE, [entry(None, {"stock": 24.8, "ipex": 88.2})])
    assert (chosen.backend, chosen.int8) == ("ipex", "stock")  # IPEX, but its INT8 measured slower
    chosen = choose_backend("ipex", amd, USABLE, [entry(None, {"stock": 30.0, "ipex": 10.0})])
    assert (chosen.backend, chosen.int8) == ("ipex", "ipex")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("onednn", amd, USABLE, [])


def test_ipex_requested_but_missing_falls_back_with_a_warning(amd, caplog):
    with caplog.at_level(logging.WARNING):
        chosen = choose_backend("ipex", amd, MISSING, [])
    assert chosen.backend == "stock" and "pip install 'mineru-fast[ipex]'" in chosen.reason
    assert "IPEX backend unavailable" in caplog.text


def test_auto_follows_the_measurement_of_this_cpu(amd):
    faster = [entry({"stock": 10.0, "ipex": 8.0}, None)]
    assert choose_backend("auto", amd, USABLE, faster).backend == "ipex"
    assert choose_backend("auto", amd, MISSING, faster).backend == "stock"
    assert choose_backend("auto", amd, USABLE, [entry({"stock": 8.0, "ipex": 10.0}, None)]).backend == "stock"
    assert choose_backend("auto", amd, USABLE, [entry({"stock": 8.0, "ipex": None}, None)]).backend == "stock"
    other = choose_backend("auto", amd, USABLE, [entry({"stock": 10.0, "ipex": 8.0}, None, vendor="GenuineIntel")])
    assert other.backend == "stock" and "no measurement for AuthenticAMD avx512_bf16" in other.reason


def test_packaged_measurements_are_well_formed():
    entries = load_measurements()
    assert entries, "the table records at least this project's own CPU"
    for e in entries:
        assert {"cpu", "vendor", "isa_tier", "page_s", "int8_linear_ms", "source"} <= set(e)
        assert e["isa_tier"] in ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "baseline")


def test_mismatched_ipex_is_reported_without_importing_it(monkeypatch):
    versions = {"intel-extension-for-pytorch": "2.8.0+cpu", "torch": "2.13.0+cpu"}
    monkeypatch.setattr(backends.importlib.metadata, "version", versions.__getitem__)
    status = ipex_status()
    assert not status.usable and status.reason == "IPEX 2.8.0+cpu needs torch 2.8.*, found torch 2.13.0+cpu"


def test_reference_engine_takes_no_ipex():
    with pytest.raises(ValueError, match="fast engine only"):
        ParserOptions.preset("reference", backend="ipex")


@pytest.mark.skipif(STATUS.usable, reason="IPEX is usable here: the fallback is not exercised")
def test_engine_falls_back_to_stock_without_ipex(tiny_model, caplog):
    with caplog.at_level(logging.WARNING):
        engine = build_engine(tiny_model, ParserOptions.preset("exact", backend="ipex", slots=2, max_seq_len=1024))
    assert engine.vision_mode == "eager" and "IPEX backend unavailable" in caplog.text


# -- IPEX against stock on the tiny model ----------------------------------------------------------


def requests() -> list[GenerationRequest]:
    """The layout request of a page and two crops. The random tiny model repeats one token; a
    large presence penalty makes every step pick a new one, so tokens follow the whole ranking."""
    page = text_page()
    out = [GenerationRequest(layout_image(page), prompt_for("layout"), SP(max_new_tokens=16))]
    for kind, box in (("text", (0.1, 0.1, 0.9, 0.3)), ("table", (0.1, 0.4, 0.9, 0.7))):
        crop = crop_block(page, LayoutBlock(kind, box))
        out.append(GenerationRequest(crop, prompt_for(kind), SP(presence_penalty=1000.0, max_new_tokens=16)))
    return out


def run(model: Path, preset: str, backend: str) -> tuple[list[torch.Tensor], list[list[int]], set[str]]:
    """First-step logits and generated tokens of every request, and the LM's module type names."""
    # float32 storage for "exact" (not its bf16-stored linears), so ipex.optimize has nn.Linear
    # layers to prepack; IPEX runs the traced vision encoder so its TorchScript fusions apply too
    storage = {"vision_quant": "none", "lm_quant": "none", "lm_head_quant": "none"} if preset == "exact" else {}
    mode = "trace" if backend == "ipex" else "eager"
    options = ParserOptions.preset(preset, backend=backend, vision_mode=mode, slots=4, max_seq_len=2048, **storage)
    engine = build_engine(model, options)
    assert engine.vision_mode == mode
    logits = []
    for request in requests():
        seq = SequenceState(0, request, engine.preprocessor.encode(request))
        engine.encode_images([seq])
        logits.append(engine.prefill(seq, 0).float())
    return logits, [r.token_ids for r in engine.generate(requests())], {type(m).__name__ for m in engine.lm.modules()}


def cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [F.cosine_similarity(x, y, dim=0).item() for x, y in zip(a, b, strict=True)]


@needs_ipex
def test_ipex_fp32_gives_the_stock_tokens(tiny_model):
    stock_logits, stock_tokens, _ = run(tiny_model, "exact", "stock")
    ipex_logits, ipex_tokens, _ = run(tiny_model, "exact", "ipex")
    assert len(set(stock_tokens[1])) == 16  # varied tokens: equality tests the logits' ranking
    assert ipex_tokens == stock_tokens
    # fp32 GEMMs of oneDNN (prepacked) and of stock torch differ only in summation order: ~1e-6 relative.
    for s, i in zip(stock_logits, ipex_logits, strict=True):
        assert (s - i).abs().max() <= 1e-4 * s.abs().max()


@needs_ipex
def test_ipex_bf16_matches_stock_bf16(tiny_model):
    stock_logits, _, _ = run(tiny_model, "bf16", "stock")
    ipex_logits, _, _ = run(tiny_model, "bf16", "ipex")
    # bf16 keeps 8 mantissa bits; the two backends round at different points of each GEMM, which
    # moves logits by ~0.5% of their scale (measured cosine 0.99997). 0.9995 allows 15x that.
    assert min(cosines(stock_logits, ipex_logits)) >= 0.9995
    assert [s.argmax() for s in stock_logits] == [i.argmax() for i in ipex_logits]


@needs_ipex
def test_ipex_int8_stays_as_close_to_fp32_as_stock_int8(tiny_model, monkeypatch):
    fp32_logits, _, _ = run(tiny_model, "exact", "stock")
    stock_logits, _, stock_types = run(tiny_model, "fast", "stock")
    topo = read_topology()
    table = [entry(None, {"stock": 2.0, "ipex": 1.0}, vendor=topo.vendor, tier=isa_tier(topo))]
    monkeypatch.setattr(backends, "load_measurements", lambda: table)  # force IPEX's INT8 path
    ipex_logits, _, ipex_types = run(tiny_model, "fast", "ipex")
    assert "WeightOnlyQuantizedLinear" in ipex_types and "WeightOnlyQuantizedLinear" not in stock_types
    # Per-channel int8 weights and per-token int8 activations err ~0.4% per linear; over the tiny
    # model's layers both INT8 paths measured cosine >= 0.9988 to fp32. 0.995 bounds a broken path.
    assert min(cosines(fp32_logits, stock_logits)) >= 0.995
    assert min(cosines(fp32_logits, ipex_logits)) >= 0.995
    assert [f.argmax() for f in fp32_logits] == [i.argmax() for i in ipex_logits]
