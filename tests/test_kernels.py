"""The own INT8 kernels (``engine.kernels``): the GEMV (``quantize.GemvInt8Linear``) gives oneDNN's
outputs bit for bit, at every row count, shape and input, alone and inside the engine; the block-wise
linear (``quantize.BlockInt8Linear``) gives its PyTorch form's; the fallbacks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_prepared import entries, make_engine, outputs
from torch import nn

import mineru_fast.engine.kernels as kernels
from mineru_fast.engine.quantize import (
    BlockInt8Linear,
    GemvInt8Linear,
    Int8BlockConfig,
    Int8DynamicConfig,
    OneDnnInt8Linear,
    block_int8_reference,
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
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"),
    [
        (1152, 896, True),  # the LM's fused QKV projection
        (896, 4864, False),  # its down projection (152 blocks)
        (1000, 100, True),  # N not a multiple of 16 (masked last tile), K not one of 32 (padded block)
        (7, 70, False),
        (3, 3, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_kernel_gives_its_pytorch_forms_outputs_bit_for_bit(out_features, in_features, bias, dtype):
    """Every row count the engine gives it (decode rows and prefill chunks, odd tails of its 4-row
    and 2-tile register blocks); each row equal alone and in the batch."""
    torch.manual_seed(out_features + in_features)
    layer = BlockInt8Linear(nn.Linear(in_features, out_features, bias=bias))
    for rows in (1, 2, 3, 4, 5, 7, 16, 17, 64):
        x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows)[:, None]
        x[0, :] = 0.0  # an all-zero row
        x[-1, : min(32, in_features)] = 0.0  # an all-zero block
        x = x.to(dtype)
        got = layer(x)
        expected = block_int8_reference(x.float(), layer.weight_packed, layer.weight_scale, layer.bias, out_features)
        assert torch.equal(got, expected.to(dtype)), (rows, dtype)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
        assert torch.equal(alone, got), rows
    assert layer(torch.randn(2, 3, in_features, dtype=dtype)).shape == (2, 3, out_features)
    assert layer(torch.empty(0, in_features)).shape == (0, out_features)


@needs_kernel
def test_the_block_kernel_refuses_what_it_cannot_run():
    op = STATUS.block_op
    layer = BlockInt8Linear(nn.Linear(64, 32))
    weight, scale = layer.weight_packed, layer.weight_scale
    with pytest.raises(RuntimeError, match="disagree on K"):
        op(torch.zeros(1, 96), weight, scale, None, 32)
    with pytest.raises(RuntimeError, match="disagree on N"):
        op(torch.zeros(1, 64), weight, scale, None, 33)
    with pytest.raises(RuntimeError, match="uint8"):
        op(torch.zeros(1, 64), weight.to(torch.int8), scale, None, 32)
    with pytest.raises(RuntimeError, match="weight_scale"):
        op(torch.zeros(1, 64), weight, scale[:1], None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.zeros(1, 64), weight, scale, torch.zeros(7), 32)


@needs_kernel
def test_an_engine_on_the_block_kernel_gives_the_same_tokens_cold_and_warm(tiny_model, tmp_path):
    """The LM and head block-wise, from the checkpoint and from the prepared cache: the same tokens
    and log-probabilities bit for bit, and those of the PyTorch form of the arithmetic."""
    block = {"lm_quant": Int8BlockConfig(), "lm_head_quant": Int8BlockConfig()}
    root = tmp_path / "prepared"
    results = []
    for source in ("checkpoint", "cache"):
        engine = make_engine(tiny_model, root, **block)
        assert engine.prepared_from == source and isinstance(engine.lm.lm_head, BlockInt8Linear)
        results.append(outputs(engine))
    assert results[0] == results[1] and len(entries(root)) == 1
    engine = make_engine(tiny_model, None, **block)
    for layer in engine.lm.modules():
        if isinstance(layer, BlockInt8Linear):
            layer._kernel = None
    assert outputs(engine) == results[0]


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
def test_the_fast_preset_puts_the_lm_on_the_block_kernel_and_vision_on_onednn(tiny_model):
    from mineru_fast import ParserOptions
    from mineru_fast.engine.factory import build_engine

    def int8_kinds(module: nn.Module) -> set[type]:
        return {type(m) for m in module.modules() if "Int8Linear" in type(m).__name__}

    engine = build_engine(tiny_model, ParserOptions(threads=1), prepared_cache=False)
    try:
        assert int8_kinds(engine.lm) == {BlockInt8Linear} and isinstance(engine.lm.lm_head, BlockInt8Linear)
        assert int8_kinds(engine.vision) == {OneDnnInt8Linear}
        assert engine.numerics["int8_kernel"] == "onednn"
        assert "own AVX-512 VNNI block" in engine.numerics["lm_int8_block"]
        assert "lm_decode_kernel" not in engine.numerics
    finally:
        engine.close()
    per_channel = ParserOptions(threads=1, lm_quant="int8-dynamic", lm_head_quant="int8-dynamic")
    gemv = build_engine(tiny_model, per_channel, prepared_cache=False)
    try:  # per-channel INT8 asked for: its decode rows on the own GEMV
        assert int8_kinds(gemv.lm) == {GemvInt8Linear} and gemv.numerics["lm_decode_kernel"] == STATUS.reason
        assert "lm_int8_block" not in gemv.numerics
    finally:
        gemv.close()
    onednn = build_engine(tiny_model, replace(per_channel, int8_kernel="onednn"), prepared_cache=False)
    try:  # and its kernel by name: oneDNN everywhere (the bench's A/B row)
        assert int8_kinds(onednn.lm) == {OneDnnInt8Linear} and "lm_decode_kernel" not in onednn.numerics
    finally:
        onednn.close()


def test_without_the_kernel_the_fast_preset_lm_is_per_channel_int8(monkeypatch, tiny_model):
    """No own kernel (here: turned off): block-wise INT8's PyTorch form would be far slower than
    per-channel INT8 on oneDNN, so the fast preset's LM runs that, and the metadata says why."""
    from mineru_fast import ParserOptions
    from mineru_fast.engine.factory import build_engine

    monkeypatch.setenv(kernels.OWN_KERNELS_ENV, "0")
    kernels.int8_gemv_status.cache_clear()
    try:
        engine = build_engine(tiny_model, ParserOptions(threads=1), prepared_cache=False)
        try:
            assert isinstance(engine.lm.lm_head, OneDnnInt8Linear)
            assert engine.numerics["lm_int8_block"].startswith("per-channel int8-dynamic instead: own INT8 GEMV off")
        finally:
            engine.close()
    finally:
        kernels.int8_gemv_status.cache_clear()


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


def test_a_build_in_progress_is_waited_for_and_a_stale_lock_is_removed(monkeypatch, tmp_path):
    """Processes started together must all get the kernels (their numerics differ from the
    fallback's): one that finds another's lock waits until it is released, within a bound."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    assert not kernels._held_by_another_build(lock) and kernels._another_build_ended(lock, wait_s=0)
    lock.touch()
    assert kernels._held_by_another_build(lock) and lock.exists()  # a live build
    assert not kernels._another_build_ended(lock, wait_s=0.3)  # still held when the bound passed
    released = threading.Event()

    def release() -> None:  # the other process finishing: waited on by event, never by a fixed sleep
        released.wait()
        lock.unlink()

    other = threading.Thread(target=release)
    other.start()
    released.set()
    assert kernels._another_build_ended(lock, wait_s=600) and not lock.exists()
    other.join()
    lock.touch()
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
    assert seen["sources"] == [str(build / source.name) for source in kernels.SOURCES]
    assert all((build / source.name).read_bytes() == source.read_bytes() for source in kernels.SOURCES)
    assert "compiling the own INT8 GEMV once for this machine" in caplog.text


@needs_kernel
def test_the_block_kernel_passes_a_nan_on_instead_of_hiding_it():
    """A NaN in a row's input makes that row's outputs NaN (as float math would), not finite
    numbers from a scale computed without it; the other rows are untouched."""
    torch.manual_seed(5)
    layer = BlockInt8Linear(nn.Linear(64, 32))
    x = torch.randn(3, 64)
    clean = layer(x)
    x[1, 40] = float("nan")
    got = layer(x)
    assert got[1].isnan().all() and torch.equal(got[[0, 2]], clean[[0, 2]])
