"""The own INT8 GEMV kernel (``engine.kernels``, ``quantize.GemvInt8Linear``): oneDNN's outputs bit
for bit, at every row count, shape and input, alone and inside the engine; the fallbacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_prepared import entries, make_engine, outputs
from torch import nn

import mineru_fast.engine.kernels as kernels
from mineru_fast.engine.quantize import (
    GemvInt8Linear,
    Int8DynamicConfig,
    OneDnnInt8Linear,
    int8_kernel_path,
    resolve_int8_backend,
)

STATUS = kernels.int8_gemv_status()
needs_kernel = pytest.mark.skipif(STATUS.op is None, reason=STATUS.reason)


@needs_kernel
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"),
    [
        (1152, 896, True),  # the LM's fused QKV projection (Qwen2: biased)
        (896, 4864, False),  # its down projection: K past 2**24 / 127**2, float(acc) rounds as oneDNN's
        (1000, 100, True),  # K not a multiple of 64 (masked tail), N not a multiple of 4 (row tail)
        (7, 70, False),
        (3, 3, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_onednns_outputs_bit_for_bit(out_features, in_features, bias, dtype):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    onednn, gemv = OneDnnInt8Linear(linear), GemvInt8Linear(linear)
    for rows in (*range(1, kernels.MAX_ROWS + 1), kernels.MAX_ROWS + 1, 64):  # the kernel, then torch._int_mm
        x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows)[:, None]  # rows of very different scales
        x[0, :] = 0.0  # an all-zero row: the smallest scale
        x = x.to(dtype)
        assert torch.equal(gemv(x), onednn(x)), (rows, dtype)
    batch = torch.randn(2, 3, in_features, dtype=dtype)  # leading dimensions kept
    assert gemv(batch).shape == (2, 3, out_features) and torch.equal(gemv(batch), onednn(batch))


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_run():
    op = STATUS.op
    weight, sums, scale = torch.zeros(8, 32, dtype=torch.int8), torch.zeros(8, dtype=torch.int32), torch.ones(8)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        op(torch.zeros(17, 32), weight, sums, scale, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        op(torch.zeros(1, 31), weight, sums, scale, None)
    with pytest.raises(RuntimeError, match="int8"):
        op(torch.zeros(1, 32), weight.float(), sums, scale, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.zeros(1, 32), weight, sums, scale, torch.zeros(7))


@needs_kernel
def test_an_engine_on_the_kernel_decodes_oneDNNs_tokens_and_logprobs_cold_and_warm(tiny_model, tmp_path):
    """The LM on ``gemv`` (decode rows on the kernel, prefill on torch._int_mm), from the checkpoint
    and from the prepared cache: the same tokens and log-probabilities, bit for bit, as oneDNN."""
    expected = outputs(make_engine(tiny_model, None))
    gemv = {"lm_quant": Int8DynamicConfig("gemv"), "lm_head_quant": Int8DynamicConfig("gemv")}
    root = tmp_path / "prepared"
    for source in ("checkpoint", "cache"):
        engine = make_engine(tiny_model, root, **gemv)
        assert engine.prepared_from == source and isinstance(engine.lm.lm_head, GemvInt8Linear)
        assert outputs(engine) == expected
    assert len(entries(root)) == 1


@needs_kernel
def test_the_fast_preset_puts_the_lm_on_the_kernel_and_vision_on_onednn(tiny_model):
    from mineru_fast import ParserOptions
    from mineru_fast.engine.factory import build_engine

    engine = build_engine(tiny_model, ParserOptions(threads=1), prepared_cache=False)
    try:
        kinds = {name: type(m) for name, m in engine.lm.named_modules() if "Int8Linear" in type(m).__name__}
        assert kinds and set(kinds.values()) == {GemvInt8Linear}  # the layers and the head
        vision = {type(m) for m in engine.vision.modules() if "Int8Linear" in type(m).__name__}
        assert vision == {OneDnnInt8Linear}
        assert engine.numerics["int8_kernel"] == "onednn" and engine.numerics["lm_decode_kernel"] == STATUS.reason
    finally:
        engine.close()
    onednn = build_engine(tiny_model, ParserOptions(threads=1, int8_kernel="onednn"), prepared_cache=False)
    try:  # asked for by name: oneDNN everywhere (the bench's A/B row)
        assert {type(m) for m in onednn.lm.modules() if "Int8Linear" in type(m).__name__} == {OneDnnInt8Linear}
        assert "lm_decode_kernel" not in onednn.numerics
    finally:
        onednn.close()


def test_without_the_kernel_gemv_is_onednn(monkeypatch):
    """Off by the variable (or no VNNI, or a failed build): ``gemv`` resolves to ``onednn`` (the same
    numerics), and the status says why."""
    monkeypatch.setenv(kernels.OWN_KERNELS_ENV, "0")
    kernels.int8_gemv_status.cache_clear()
    try:
        status = kernels.int8_gemv_status()
        assert status.op is None and f"{kernels.OWN_KERNELS_ENV}=0" in status.reason
        assert resolve_int8_backend("gemv") == "onednn"
        assert "oneDNN u8s8s32" in int8_kernel_path("gemv")
    finally:
        kernels.int8_gemv_status.cache_clear()


def test_a_failed_build_leaves_onednn_with_the_reason(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*_args, **_kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv(kernels.OWN_KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels, "isa_class", lambda _isa: type("Cls", (), {"vnni": True, "name": "amx"})())
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    kernels.int8_gemv_status.cache_clear()
    try:
        status = kernels.int8_gemv_status()
        assert status.op is None and "not built (RuntimeError: Ninja is required" in status.reason
    finally:
        kernels.int8_gemv_status.cache_clear()


def test_a_cpu_without_vnni_keeps_onednn(monkeypatch):
    monkeypatch.delenv(kernels.OWN_KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels, "isa_class", lambda _isa: type("Cls", (), {"vnni": False, "name": "avx2"})())
    kernels.int8_gemv_status.cache_clear()
    try:
        status = kernels.int8_gemv_status()
        assert status.op is None and status.reason.endswith("this CPU class is avx2")
    finally:
        kernels.int8_gemv_status.cache_clear()


def test_a_build_in_progress_is_not_waited_for_and_a_stale_lock_is_removed(monkeypatch, tmp_path):
    import os
    import time

    lock = tmp_path / "lock"
    assert not kernels._held_by_another_build(lock)
    lock.touch()
    assert kernels._held_by_another_build(lock) and lock.exists()  # a live build: not waited for
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert not kernels._held_by_another_build(lock) and not lock.exists()  # a killed build's lock


def test_the_build_goes_to_torch_extensions_dir_and_a_first_build_is_announced(monkeypatch, tmp_path, caplog):
    import torch.utils.cpp_extension as cpp_extension

    seen = {}

    def recording_load(name, sources, **kwargs):
        seen.update(kwargs, name=name, sources=sources)
        raise RuntimeError("stop here")

    monkeypatch.delenv(kernels.OWN_KERNELS_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "isa_class", lambda _isa: type("Cls", (), {"vnni": True, "name": "amx"})())
    monkeypatch.setattr(cpp_extension, "load", recording_load)
    kernels.int8_gemv_status.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=kernels.__name__):
            status = kernels.int8_gemv_status()
    finally:
        kernels.int8_gemv_status.cache_clear()
    build = Path(seen["build_directory"])
    assert status.op is None and build.parent.parent == tmp_path and build.name.startswith(kernels.NAME + "-")
    # built from a copy inside the build folder: two checkouts of the same code share one build
    assert seen["sources"] == [str(build / "int8_gemv.cpp")]
    assert (build / "int8_gemv.cpp").read_bytes() == kernels.SOURCE.read_bytes()
    assert "compiling the own INT8 GEMV once for this machine" in caplog.text
