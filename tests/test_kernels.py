"""The own INT8 kernels (``engine.kernels``): the GEMV (``quantize.GemvInt8Linear``) gives oneDNN's
outputs bit for bit, at every row count, shape and input, alone and inside the engine; the block-wise
linear (``quantize.BlockInt8Linear``) gives its PyTorch form's; the fallbacks."""

from __future__ import annotations

import os
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


def a_start() -> kernels.KernelStatus:
    """``int8_gemv_status`` as a new process would find it (the cached status cleared before and after)."""
    kernels.int8_gemv_status.cache_clear()
    try:
        return kernels.int8_gemv_status()
    finally:
        kernels.int8_gemv_status.cache_clear()


def fake_vnni(monkeypatch, extensions: Path) -> None:
    """A CPU class with AVX-512 VNNI and an empty extension folder, whatever this machine is."""
    monkeypatch.delenv(kernels.OWN_KERNELS_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setattr(kernels, "isa_class", lambda _isa: type("Cls", (), {"vnni": True, "name": "amx"})())


def test_a_failed_build_leaves_onednn_with_the_reason_and_is_not_retried(monkeypatch, tmp_path):
    """Audit round 4, N16: a failed build was retried at every start (12-27 s each) and said only
    PyTorch's last line; the compiler's error line is the reason now, kept until removed."""
    import torch.utils.cpp_extension as cpp_extension

    calls = []

    def failing_compiler(*_args, **_kwargs):
        calls.append(1)
        log = "Error building extension\nint8_block.cpp:12:3: error: 'x' was not declared\nninja: build stopped"
        raise RuntimeError(log)

    fake_vnni(monkeypatch, tmp_path)
    monkeypatch.setattr(cpp_extension, "load", failing_compiler)
    first, second = a_start(), a_start()  # a start, then the next one
    assert first.op is None and first.reason == (
        "own INT8 GEMV not built (RuntimeError: int8_block.cpp:12:3: error: 'x' was not declared)"
    )
    failed = next(tmp_path.rglob("failed.txt"))
    assert second.op is None and second.reason == f"{first.reason}; remove {failed} to build again"
    assert len(calls) == 1  # not built again
    assert not list(failed.parent.glob(".staging-*"))  # the private build folder is gone


def test_a_killed_build_does_not_hold_up_the_next_start(monkeypatch, tmp_path):
    """Audit round 4, N3: a build killed by SIGKILL left PyTorch's lock file, and every start in
    the next 10 minutes waited for it (or, in PyTorch's own wait, forever). Here a process is
    killed while it builds (its compiler stubbed to block); the next start takes the lock at
    once, clears what the killed build left and builds anew."""
    import signal
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp_extension

    child = r"""
import sys, threading
import torch.utils.cpp_extension as cpp_extension
import mineru_fast.engine.kernels as kernels
kernels.isa_class = lambda _isa: type("Cls", (), {"vnni": True, "name": "amx"})()
def compiling(*args, **kwargs):
    print("compiling", flush=True)
    threading.Event().wait()
cpp_extension._write_ninja_file_and_build_library = compiling
kernels.int8_gemv_status()
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), kernels.OWN_KERNELS_ENV: "1"}
    builder = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert builder.stdout.readline().strip() == "compiling"  # inside PyTorch's builder, its lock taken
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait(60)
    (build,) = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    seen = []

    def recording_load(name, sources, **kwargs):
        seen.append(kwargs["build_directory"])
        raise RuntimeError("stop here")

    fake_vnni(monkeypatch, tmp_path)
    monkeypatch.setattr(kernels, "BUILD_WAIT_S", 30.0)  # on 44d1b50 the killed build's lock was waited for
    monkeypatch.setattr(cpp_extension, "load", recording_load)
    status = a_start()
    assert status.reason == "own INT8 GEMV not built (RuntimeError: stop here)"  # built again, not waited for
    assert len(seen) == 1 and Path(seen[0]).parent == build
    assert [p.name for p in build.iterdir() if p.name.startswith(".staging-")] == []  # the killed build's folder too


def test_a_cpu_without_vnni_keeps_onednn(monkeypatch):
    monkeypatch.delenv(kernels.OWN_KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels, "isa_class", lambda _isa: type("Cls", (), {"vnni": False, "name": "avx2"})())
    kernels.int8_gemv_status.cache_clear()
    try:
        status = kernels.int8_gemv_status()
        assert status.op is None and status.reason.endswith("this CPU class is avx2")
    finally:
        kernels.int8_gemv_status.cache_clear()


def test_a_built_library_damaged_on_disk_is_built_again_not_loaded(monkeypatch, tmp_path, caplog):
    """Issue 48: the kernels' build artefact is verified like the prepared cache: a library whose
    bytes are not those its build recorded (or without a record) is never loaded."""
    import torch.utils.cpp_extension as cpp_extension

    seen = []

    def recording_load(name, sources, **kwargs):
        seen.append(kwargs["build_directory"])
        raise RuntimeError("stop here")

    fake_vnni(monkeypatch, tmp_path)
    monkeypatch.setattr(cpp_extension, "load", recording_load)
    build = kernels._build_directory()
    build.mkdir(parents=True)
    library = build / f"{kernels.NAME}.so"
    for record in ("0" * 64, None):
        library.write_bytes(b"\x7fELF damaged")
        if record is not None:
            (build / f"{kernels.NAME}.so.sha256").write_text(record + "\n")
        with caplog.at_level("WARNING", logger=kernels.__name__):
            status = a_start()
        assert status.reason == "own INT8 GEMV not built (RuntimeError: stop here)"  # built again, not loaded
        assert not library.exists() and "does not match the digest recorded" in caplog.text
        (build / "failed.txt").unlink()
        caplog.clear()
    assert len(seen) == 2


def test_a_build_in_progress_is_waited_for_within_a_bound(tmp_path):
    """Processes started together must all get the kernels (their numerics differ from the
    fallback's): one that finds the build lock held waits until it is released, within a bound."""
    import threading

    building, release = threading.Event(), threading.Event()
    outcome = []

    def other_build() -> None:  # another builder; waited on by events, never by a fixed sleep
        with kernels._build_lock(tmp_path, wait_s=0) as held:
            outcome.append(held)
            building.set()
            release.wait()

    other = threading.Thread(target=other_build)
    other.start()
    try:
        assert building.wait(60) and outcome == [True]
        with kernels._build_lock(tmp_path, wait_s=0.3) as held:
            assert not held  # still held when the bound passed
    finally:
        release.set()
        other.join(60)
    with kernels._build_lock(tmp_path, wait_s=600) as held:
        assert held


def test_the_build_goes_to_torch_extensions_dir_and_a_first_build_is_announced(monkeypatch, tmp_path, caplog):
    import torch.utils.cpp_extension as cpp_extension

    seen = {}

    def recording_load(name, sources, **kwargs):
        seen.update(kwargs, name=name, sources=sources)
        seen["copies"] = [Path(source).read_bytes() for source in sources]
        raise RuntimeError("stop here")

    fake_vnni(monkeypatch, tmp_path)
    monkeypatch.setattr(cpp_extension, "load", recording_load)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        status = a_start()
    staging = Path(seen["build_directory"])
    build = staging.parent
    assert status.op is None and build.parent.parent == tmp_path and build.name.startswith(kernels.NAME + "-")
    # built from copies in a private folder inside the build folder: two checkouts of the same
    # code share one build, and a killed build leaves nothing there that a later start loads
    assert staging.name.startswith(".staging-") and not staging.exists()
    assert seen["sources"] == [str(staging / source.name) for source in kernels.SOURCES]
    assert seen["copies"] == [source.read_bytes() for source in kernels.SOURCES]
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
