"""Stage-table rows: cumulative configurations, each run in its own process.

Run one row: ``python -m mineru_fast.bench.rows '<json spec>'`` prints one JSON line with the
row's raw samples (wall time, per-page stage split, peak RSS, start-up time, Markdown). The
shipped preset's row also measures, in the same process on the same parser, the concurrency table
(``"concurrency": [levels]`` in the spec; one call is the stage measurement itself when the
workload is one page) and the roofline (``"roofline": true``), so every figure of one quantity
comes from one measurement.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mineru_fast.engine.memory import peak_rss_bytes


@dataclass(frozen=True)
class Row:
    """One stage of the table: a label and the ``ParserOptions`` preset + overrides it runs.

    ``quick``: part of ``--quick`` (the baseline, the shipped preset, its language model with
    per-channel INT8 instead of 32-value blocks, and the other INT8 kernel ``auto`` chooses
    between): ``"always"``, ``"native-bf16"`` / ``"emulated-bf16"`` (only on ISA classes with /
    without native bfloat16), or ``""`` (full run only). ``candidate``: the row is
    this ``choice.CANDIDATES`` configuration (batched, as shipped), so ``auto`` is checked against it.
    """

    label: str
    preset: str
    overrides: dict = field(default_factory=dict)
    quick: str = ""
    instances: int = 1  # > 1: that many pinned processes splitting the cores (see bench.instances)
    candidate: str | None = None

    def in_quick(self, native_bf16: bool) -> bool:
        """Whether ``--quick`` runs this row on a class with or without native bfloat16."""
        return self.quick == "always" or self.quick == ("native-bf16" if native_bf16 else "emulated-bf16")

    def options(self, threads: int | None = None):
        """The row's ``ParserOptions``."""
        from mineru_fast.options import ParserOptions

        return ParserOptions.preset(self.preset, threads=threads, **self.overrides)

    def unavailable(self) -> str | None:
        """Why this machine cannot run the row (shown in the table instead), or None."""
        from mineru_fast.runtime.choice import choose_int8_kernel
        from mineru_fast.runtime.cpu import isa_class

        options = self.options()
        if options.precision == "bf16":
            cls = isa_class(_topology().isa)
            if not cls.native_bf16:
                return f"bf16 is emulated on {cls.name} (no native bfloat16): not run"
        kernel = self.overrides.get("int8_kernel")
        if kernel and kernel == choose_int8_kernel("auto", _topology()).value:
            return f"int8_kernel=auto runs {kernel} on this class: see '+ continuous batching'"
        if self.overrides.get("backend") == "ipex":
            from mineru_fast.engine.backends import ipex_status

            status = ipex_status()
            return None if status.usable else status.reason
        if self.instances > 1:
            topology = _topology()
            if topology.usable_cores < self.instances:
                return f"{topology.usable_cores} usable core(s): fewer than {self.instances} instances"
        return None


def _topology():
    from mineru_fast.runtime.cpu import read_topology

    return read_topology()


_SINGLE = {"slots": 1, "page_window": 1}
_FP32_WEIGHTS = {"lm_quant": "none", "lm_head_quant": "none"}  # the exact preset's LM, in float32 storage
_PER_CHANNEL_LM = {"lm_quant": "int8-dynamic", "lm_head_quant": "int8-dynamic"}  # the LM before 32-value blocks
ROWS: list[Row] = [
    Row("reference fp32", "reference-fp32", quick="emulated-bf16"),  # the baseline where bf16 is emulated
    Row("reference bf16", "reference", quick="native-bf16"),
    Row("fast engine fp32 (static KV)", "exact", {**_SINGLE, **_FP32_WEIGHTS}),
    Row("+ compiled vision (torch.compile)", "exact", {**_SINGLE, **_FP32_WEIGHTS, "vision_mode": "compile"}),
    # eager vision from here on: compile bought nothing in steady state (benchmarks/README.md)
    Row("+ dynamic INT8 (eager vision)", "fast", {**_SINGLE}),
    # The fast preset as shipped; its candidate is int8-<the kernel int8_kernel=auto runs>.
    Row("+ continuous batching", "fast", quick="always", candidate="int8-auto"),
    # Its LM with per-channel / per-token INT8 (decode rows on the own GEMV): the A/B of 32-value blocks.
    Row("  LM INT8 per channel / per token", "fast", _PER_CHANNEL_LM, "always"),
    # The same with each other INT8 kernel for int8-dynamic layers (a kernel int8_kernel=auto
    # already runs is not repeated).
    Row("  INT8 per token, oneDNN", "fast", {"int8_kernel": "onednn"}, "always", candidate="int8-onednn"),
    Row("  INT8 per tensor, torch.ao", "fast", {"int8_kernel": "torch_ao"}, "always", candidate="int8-torch_ao"),
    Row("  INT8 per token, torch._int_mm", "fast", {"int8_kernel": "int_mm"}, candidate="int8-int_mm"),
    Row("bf16 preset", "bf16", candidate="bf16"),
    # The fast preset's options on IPEX (torch 2.8 + the ipex extra).
    Row("+ IPEX backend", "fast", {"backend": "ipex"}, quick="always"),
    # 2 pinned processes on half the cores each, against the fast preset row (one process, all
    # cores): `bench --only "continuous batching" --only instance` runs the pair.
    Row("+ 2 pinned instances", "fast", instances=2),
]


def warm_up(parser) -> float:
    """One small replayed text-crop request through the engine (vision, prefill and decode paths),
    so first-call costs are paid before timing. Not a full page: every page's layout pass is a
    1036x1036 image (~45 s of vision work on 2 cores), which is not start-up time.

    Returns:
        Seconds taken.

    Raises:
        RuntimeError: the request failed.
    """
    from PIL import Image

    from mineru_fast.engine.base import GenerationRequest
    from mineru_fast.protocol.spec import prompt_for

    request = GenerationRequest(
        Image.new("RGB", (280, 56), "white"), prompt_for("text"), parser.options.sampling("text"), forced_text="ok"
    )
    start = time.perf_counter()
    (result,) = parser.engine.generate([request])
    if result.finish_reason == "error":
        raise RuntimeError(f"warm-up request failed: {result.error}")
    return time.perf_counter() - start


def run_row(spec: dict) -> dict:
    """Load, warm up and parse the workload with one row's options (in this process)."""
    from mineru_fast.bench.workload import load_workload
    from mineru_fast.options import ParserOptions
    from mineru_fast.pipeline.parser import DocumentParser
    from mineru_fast.protocol.traces import Trace

    options = ParserOptions.preset(spec["preset"], threads=spec["threads"], **spec["overrides"])
    workload, profile = (Path(spec[k]) if spec.get(k) else None for k in ("workload", "profile"))
    pages = load_workload(spec["pages"], workload, profile=profile)
    start = time.perf_counter()
    parser = DocumentParser.from_pretrained(spec["model"], options)
    load_s = time.perf_counter() - start
    warmup_s = warm_up(parser)
    if spec.get("barrier"):  # several instances start parsing together (see bench.instances)
        print("ready", flush=True)
        sys.stdin.readline()
    start = time.perf_counter()
    document = parser.parse([p.image for p in pages], replay=Trace([p.trace for p in pages]))
    wall_s = time.perf_counter() - start
    failures = [[str(e) for e in p.errors] for p in document.pages if p.status != "success"]
    memory = parser.engine.memory_report() if hasattr(parser.engine, "memory_report") else None
    extras: dict = {}
    if spec.get("concurrency"):
        single = wall_s if len(pages) == 1 else None  # one call of the median page: the stage parse itself
        extras["concurrency"] = concurrency_table(parser, pages[0], tuple(spec["concurrency"]), single)
    if spec.get("phases") and hasattr(parser.engine, "stage_seconds"):
        extras["phases"] = phase_breakdown(parser, pages[0])
    if spec.get("roofline"):
        extras["roofline"] = roofline(parser.engine)
    return {
        **extras,
        "memory": memory,
        "label": spec["label"],
        "numerics": getattr(parser.engine, "numerics", None),
        "pages": [p.name for p in pages],
        "page_seconds": [p.timings.get("total", 0.0) for p in document.pages],
        "wall_s": wall_s,
        "timings": document.timings,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "peak_rss_gb": peak_rss_bytes() / 1e9,
        "markdown": document.to_markdown(),
        "failures": failures,
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def concurrency_table(parser, page, levels: tuple[int, ...], single_s: float | None = None) -> list[dict]:
    """N concurrent ``parse`` calls of ``page`` (a ``WorkloadPage``) through one ``DocumentParser``.

    ``single_s``: the wall seconds of one call of ``page`` already measured on this parser (the
    stage row's parse when its workload is that one page); level 1 is then that measurement
    (``"measured": "stage row"``), not a second one of the same quantity.
    """
    from mineru_fast.protocol.traces import Trace

    out = []
    for n in levels:
        if n == 1 and single_s is not None:
            out.append({"concurrency": 1, "wall_s": single_s, "pages_per_min": 60 / single_s,
                        "latencies_s": [single_s], "p50_s": single_s, "p95_s": single_s,
                        "measured": "stage row"})  # fmt: skip
            continue
        latencies: list[float] = []

        def call(latencies: list[float] = latencies) -> None:
            start = time.perf_counter()
            parser.parse([page.image], replay=Trace([page.trace]))
            latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        workers = [threading.Thread(target=call) for _ in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - start
        out.append({"concurrency": n, "wall_s": wall, "pages_per_min": 60 * n / wall, "latencies_s": latencies,
                    "p50_s": statistics.median(latencies), "p95_s": _percentile(latencies, 0.95),
                    "measured": "here"})  # fmt: skip
    return out


def phase_breakdown(parser, page) -> list[dict]:
    """Where ``page``'s time goes in the fast engine: its layout request alone, then all its crop
    requests at once (as the parser sends them, replayed: ``fidelity.page_requests``), each phase
    with its wall seconds and the engine loop's seconds per stage over it
    (``FastEngine.stage_seconds``: vision linears / attention / other, prefill, decode forward /
    other, idle) and ``loop_other_s``, the wall time left (the loop's own work between units,
    waiting for a CPU). Failed requests are listed by their errors.
    """
    from mineru_fast.bench.fidelity import page_requests

    engine = parser.engine
    requests = [request for _, request in page_requests(page, parser.options)]
    phases = []
    for name, batch in (("layout pass", requests[:1]), ("crops, all at once", requests[1:])):
        start = time.perf_counter()  # the two readings lie within the wall time
        before = engine.stage_seconds()
        results = engine.generate(batch)
        after = engine.stage_seconds()
        wall_s = time.perf_counter() - start
        stages = {stage: seconds - before[stage] for stage, seconds in after.items()}
        phases.append({
            "phase": name,
            "requests": len(batch),
            "output_tokens": sum(len(r.token_ids) for r in results),
            "wall_s": wall_s,
            "stages_s": stages,
            "loop_other_s": wall_s - sum(stages.values()),
            "errors": [r.error for r in results if r.finish_reason == "error"],
        })  # fmt: skip
    return phases


def roofline(engine) -> dict:
    """This CPU's measured peaks and the fast-preset ``engine``'s achieved fraction of them."""
    from mineru_fast.bench import roofline as rf

    vision = engine.vision.config
    full_size = vision.embed_dim == rf.VISION_DIM  # a test model: small shapes, and fractions of little meaning
    gemm = rf.gemm_peaks(vision.embed_dim, vision.embed_dim * vision.mlp_ratio)
    memory_gbps = rf.memory_bandwidth(512 if full_size else 64)
    peaks = {"gemm": gemm, "memory_gbps": memory_gbps}
    from mineru_fast.engine.quantize import BLOCK, BlockInt8Linear

    # the fast preset stores int8 weights, on 32-value blocks with a float32 scale each
    got = rf.achieved(engine, bytes_per_weight=1 + 4 / BLOCK if isinstance(engine.lm.lm_head, BlockInt8Linear) else 1.0)
    own_attention = engine.vision.blocks[0].attention_kernel is not None  # set on float32 encoders only
    return {
        "full_size": full_size,
        "peaks": peaks,
        "achieved": got,
        "vision_attention": "own bf16" if own_attention else "fp32 SDPA",
        "fraction": {
            "vision_linears_of_int8_peak": got["vision_linears_gops"] / gemm["int8"],
            "vision_attention_of_fp32_peak": got["vision_attention_gflops"] / gemm["fp32"],
            # the own kernel's dot products are bfloat16 ones (where it runs; SDPA's are float32)
            "vision_attention_of_bf16_peak": got["vision_attention_gflops"] / gemm["bf16"],
            "decode_batch1_of_bandwidth": got["decode_batch1_gbps"] / memory_gbps,
        },
    }


if __name__ == "__main__":
    print(json.dumps(run_row(json.loads(sys.argv[1]))))
