"""``mineru-fast info``: what it reports for fake machines and that the command runs here."""

from __future__ import annotations

import json

import pytest
from fake_machine import SPR_FLAGS, build_machine

from mineru_fast.cli.info import collect, render
from mineru_fast.cli.main import main
from mineru_fast.engine import kernels
from mineru_fast.runtime.cpu import read_topology


def test_two_socket_amx_machine(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sysfs, proc = build_machine(tmp_path, 2, 4, smt=2, flags=SPR_FLAGS, vendor="GenuineIntel")
    info = collect(read_topology(sysfs, proc, affinity=set(range(16))))
    assert info["topology"]["sockets"] == 2 and info["topology"]["physical_cores"] == 8
    assert [n["cpus"] for n in info["topology"]["numa_nodes"]] == ["0-3,8-11", "4-7,12-15"]
    assert info["cpu"]["isa_tier"] == "amx" and info["threads"]["intra_op"] == 8
    assert info["backends"]["auto_chooses"]["backend"] == "stock"  # no measurement for this CPU
    text = render(info)
    assert "2 socket(s), 8 physical core(s), 16 logical CPU(s), 2 NUMA node(s)" in text and "AMX: yes" in text
    # AVX-512 VNNI: the fast preset's language model on the block kernel's VNNI path; turned off,
    # the same arithmetic in PyTorch (never another quantization)
    assert info["choices"]["lm_quant_fast"]["path"] == "avx512_vnni"
    assert "language model runs int8-block: 32-value INT8 scales on the own kernel's avx512_vnni path" in text
    monkeypatch.setenv("MINERU_FAST_OWN_KERNELS", "0")
    kernels.kernel_status.cache_clear()
    try:
        off = collect(read_topology(sysfs, proc, affinity=set(range(16))))["choices"]["lm_quant_fast"]
    finally:
        kernels.kernel_status.cache_clear()
    assert off["quant"] == "int8-block" and off["path"] == off["decode_attention"] == "pytorch"
    assert off["reason"].startswith("own kernels off (MINERU_FAST_OWN_KERNELS=0)")


def test_an_avx2_machine_runs_the_block_kernels_avx2_path(tmp_path):
    sysfs, proc = build_machine(tmp_path, 1, 4, flags="fpu sse2 avx2 fma", vendor="AuthenticAMD")
    info = collect(read_topology(sysfs, proc, affinity=set(range(4))))
    assert info["cpu"]["isa_tier"] == "avx2"
    assert info["choices"]["lm_quant_fast"] == {
        "quant": "int8-block",
        "path": "avx2",
        "reason": "32-value INT8 scales on the own kernel's avx2 path (the same arithmetic on every path); "
        "decode attention on the own kernel's avx2 path",
        "decode_attention": "avx2",
    }
    # no AVX-512 BF16: the vision attention is the own float32 kernel, and the report says so
    assert info["choices"]["vision_attention_fast"] == {"attention": "fp32", "reason": kernels.F32_ATTENTION}
    assert f"vision attention: {kernels.F32_ATTENTION}" in render(info)
    # its vision linears on the own AVX2 GEMM (where this install runs the kernels)
    if kernels.kernel_status().block is not None:
        assert info["choices"]["vision_linears_fast"] == {"gemm": "own_avx2", "reason": kernels.OWN_GEMM}
        assert f"vision linears: {kernels.OWN_GEMM}" in render(info)


def test_an_avx2_machine_on_a_lowered_path_reports_float32_sdpa(tmp_path, monkeypatch):
    """The float32 kernel needs the kernels' avx2 path: lowered to the portable one, the report
    says float32 SDPA runs, and why, as the engine decides it (kernels.f32_attention_status)."""
    if kernels.kernel_status().block is None:
        pytest.skip(kernels.kernel_status().reason)
    monkeypatch.setenv("MINERU_FAST_KERNEL_PATH", "portable")
    sysfs, proc = build_machine(tmp_path, 1, 4, flags="fpu sse2 avx2 fma", vendor="AuthenticAMD")
    info = collect(read_topology(sysfs, proc, affinity=set(range(4))))
    assert info["choices"]["lm_quant_fast"]["path"] == "portable"
    assert info["choices"]["vision_attention_fast"] == {
        "attention": "fp32",
        "reason": kernels.f32_attention_path_reason("portable"),
    }
    assert info["choices"]["vision_linears_fast"] == {
        "gemm": "onednn",
        "reason": f"{kernels.ONEDNN_GEMM}: the own per-channel GEMM needs the kernels' avx2 path (portable here)",
    }


def test_an_avx512_machine_without_bf16_reports_float32_sdpa(tmp_path):
    """AVX-512 without BF16 (Skylake-SP to Ice Lake): PyTorch's float32 SDPA, faster there than
    the own AVX2 float32 kernel."""
    flags = "fpu sse2 avx2 fma avx512f avx512bw avx512vl"
    sysfs, proc = build_machine(tmp_path, 1, 4, flags=flags, vendor="GenuineIntel")
    info = collect(read_topology(sysfs, proc, affinity=set(range(4))))
    assert info["choices"]["vision_attention_fast"] == {"attention": "fp32", "reason": kernels.NO_BF16_ATTENTION}
    assert info["choices"]["vision_linears_fast"]["gemm"] == "onednn"  # its AVX-512 GEMM is twice as wide
    assert info["choices"]["vision_linears_fast"]["reason"].endswith("is for the avx2 class")


def test_info_json_runs_here(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MINERU_FAST_CACHE", str(tmp_path))  # an empty cache, whatever other tests prepared
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    here = read_topology()
    assert info["allowed"]["usable_cores"] == here.usable_cores
    assert len(info["topology"]["numa_nodes"]) == len(here.nodes)
    assert info["isa"] == here.isa
    assert info["prepared_cache"] == {"root": str(tmp_path / "prepared"), "entries": 0, "bytes": 0}
    assert info["model"]["default"] == "opendatalab/MinerU2.5-Pro-2605-1.2B"  # mineru 4.0.12's registry
    assert info["model"]["protocol_version"] == "pro-2605"
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto chooses:" in out and "0 prepared model(s), 0.00 GB" in out
    assert "Model:      opendatalab/MinerU2.5-Pro-2605-1.2B (pro-2605 protocol" in out
    assert "--model 2509 (opendatalab/MinerU2.5-2509-1.2B)" in out
    assert ("Renderer:   DocVortex" in out) == (info["renderer"]["docvortex"] is not None)


def test_a_machine_without_avx2_runs_the_portable_path_and_pytorchs_decode_attention(tmp_path):
    sysfs, proc = build_machine(tmp_path, 1, 2, flags="fpu sse2", vendor="GenuineIntel")
    info = collect(read_topology(sysfs, proc, affinity=set(range(2))))
    choice = info["choices"]["lm_quant_fast"]
    assert choice["path"] == "portable" and choice["decode_attention"] == "pytorch"
    assert "decode attention on PyTorch's operators (no own one on the portable path)" in render(info)
