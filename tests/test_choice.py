"""ISA classes (with simulation caps) and the choices made from them and from recorded figures."""

from __future__ import annotations

import logging

import pytest
from fake_machine import SPR_FLAGS, build_machine

from mineru_fast import ParserOptions
from mineru_fast.cli.info import collect, render
from mineru_fast.engine.numerics import describe, warn_if_emulated_bf16
from mineru_fast.runtime.choice import choose_int8_kernel, choose_preset
from mineru_fast.runtime.cpu import ISA_FLAGS, isa_class, read_topology, simulation_env

AVX512_BF16 = {f: f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16") for f in ISA_FLAGS}
AVX2 = {f: f == "avx2" for f in ISA_FLAGS}


def test_isa_class_from_flags_and_caps():
    assert isa_class(AVX512_BF16, {}).name == "avx512_bf16"
    assert isa_class(AVX2, {}).name == "avx2" and not isa_class(AVX2, {}).native_bf16
    capped = isa_class(AVX512_BF16, simulation_env("avx2"))
    assert (capped.name, capped.hardware, capped.native_bf16, capped.vnni) == ("avx2", "avx512_bf16", False, False)
    assert set(capped.capped_by) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS",
                                     "MKL_ENABLE_INSTRUCTIONS"}  # fmt: skip
    assert isa_class(AVX512_BF16, {"DNNL_MAX_CPU_ISA": "avx512_core_vnni"}).name == "avx512_vnni"
    assert isa_class(AVX512_BF16, simulation_env("avx512")).name == "avx512"
    # a cap above the hardware, or a value the libraries do not know, lowers nothing
    assert isa_class(AVX2, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}).capped_by == {}
    assert isa_class(AVX512_BF16, {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL"}).capped_by == {}
    with pytest.raises(ValueError, match="can simulate"):
        simulation_env("amx")


def _entry(figures: dict, vendor: str = "AuthenticAMD", tier: str = "avx512_bf16", key: str = "candidates_s") -> dict:
    return {"cpu": f"{vendor} box", "vendor": vendor, "isa_tier": tier, key: figures}


@pytest.fixture
def amd(tmp_path):
    sysfs, proc = build_machine(tmp_path, 1, 2, flags=" ".join(f for f, v in AVX512_BF16.items() if v))
    return read_topology(sysfs, proc, affinity={0, 1})


def test_int8_kernel_auto_is_always_per_token(amd):
    def kernel(figures, **kw):
        return choose_int8_kernel("auto", amd, [_entry(figures, **kw)], {})

    assert kernel({"int8-onednn": 104.0, "int8-torch_ao": 100.0}).value == "onednn"
    slower = kernel({"int8-onednn": 133.0, "int8-torch_ao": 119.0})  # per tensor 11% faster: still per token
    assert slower.value == "onednn" and "per-tensor INT8 is never chosen on speed" in slower.reason
    assert kernel({"int8-onednn": 106.0, "int8-int_mm": 101.0, "int8-torch_ao": 100.0}).value == "int_mm"
    assert kernel({"onednn": 50.0, "int_mm": 45.0, "torch_ao": 40.0}, key="int8_layers_ms").value == "int_mm"
    assert kernel({"onednn": 50.0, "torch_ao": 40.0}, key="int8_layers_ms").value == "onednn"  # kernel sums
    assert choose_int8_kernel("torch_ao", amd, [], {}).value == "torch_ao"  # asked for: given
    # the same vendor's entry wins over another vendor's
    entries = [_entry({"int8-onednn": 200.0, "int8-torch_ao": 100.0}, vendor="GenuineIntel"),
               _entry({"int8-onednn": 100.0, "int8-torch_ao": 100.0})]  # fmt: skip
    assert choose_int8_kernel("auto", amd, entries, {}).value == "onednn"


def test_auto_preset_takes_the_fastest_and_never_emulated_bf16(amd):
    figures = {"int8-onednn": 100.0, "int8-torch_ao": 98.0, "bf16": 90.0}
    assert choose_preset(amd, [_entry(figures)], {}).value == "bf16"
    avx2 = choose_preset(amd, [_entry(figures, tier="avx2")], simulation_env("avx2"))
    assert avx2.value == "int8-onednn" and "bf16 left out: emulated" in avx2.reason  # and never per tensor
    nothing = choose_preset(amd, [], {})
    assert nothing.value == "int8-onednn" and "nothing recorded for avx512_bf16" in nothing.reason


def test_auto_preset_options(monkeypatch):
    here = isa_class(read_topology().isa).name
    entry = {"cpu": "x", "vendor": read_topology().vendor, "isa_tier": here,
             "candidates_s": {"int8-torch_ao": 1.0, "int8-int_mm": 1.5, "int8-onednn": 2.0}}  # fmt: skip
    monkeypatch.setattr("mineru_fast.runtime.choice.load_measurements", lambda: [entry])
    options = ParserOptions.preset("auto", threads=1)
    assert (options.int8_kernel, options.vision_quant, options.threads) == ("int_mm", "int8-dynamic", 1)
    with pytest.raises(ValueError, match="unknown preset"):
        ParserOptions.preset("fastest")


def test_describe_and_bf16_warning(amd, caplog, monkeypatch):
    monkeypatch.setattr("mineru_fast.runtime.choice.load_measurements", lambda: [])
    bf16 = ParserOptions.preset("bf16")
    assert describe(bf16, amd, {})["bf16"] == "native"
    assert describe(bf16, amd, simulation_env("avx2"))["bf16"] == "emulated"
    fast = describe(ParserOptions.preset("fast"), amd, {})
    assert fast["int8_kernel"] == "onednn" and "per token" in fast["int8_kernel_path"]
    assert fast["isa_class"] == "avx512_bf16" and fast["bf16"] is None
    # no int8-dynamic layer: no per-token kernel to report (the block kernel is reported by the engine)
    all_block = ParserOptions(vision_quant="int8-block", lm_quant="int8-block", lm_head_quant="int8-block")
    block = describe(all_block, amd, {})
    assert block["int8_kernel"] is None and block["int8_kernel_path"] is None
    for name, value in simulation_env("avx2").items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="mineru_fast.runtime.choice"):
        assert warn_if_emulated_bf16(bf16, amd) is True
        assert warn_if_emulated_bf16(ParserOptions.preset("fast"), amd) is False
    assert "emulates it" in caplog.text


def test_info_shows_the_class_and_the_choices(tmp_path, monkeypatch):
    monkeypatch.setattr("mineru_fast.runtime.choice.load_measurements", lambda: [])
    for name, value in simulation_env("avx2").items():
        monkeypatch.setenv(name, value)
    sysfs, proc = build_machine(tmp_path, 1, 2, flags=SPR_FLAGS, vendor="GenuineIntel")
    info = collect(read_topology(sysfs, proc, affinity={0, 1}))
    assert (info["cpu"]["isa_tier"], info["cpu"]["hardware_isa_tier"]) == ("avx2", "amx")
    assert info["choices"]["auto_preset"]["candidate"] == "int8-onednn"
    text = render(info)
    assert "ISA class avx2 (hardware amx, capped by ATEN_CPU_CAPABILITY=avx2" in text
    assert "bf16 emulated" in text and "auto runs int8-onednn" in text and "int8_kernel=auto" in text
