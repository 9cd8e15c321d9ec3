"""``mineru-fast bench``: the latency tables on this CPU.

Stage table (cumulative rows, each in its own process, replayed workload pages), with the
fidelity of each fast-engine row's numerics against the float32 engine on the median page
(``bench.fidelity``, its own process), concurrency table (N concurrent ``parse`` calls through one
parser) and roofline (measured peaks and the engine's achieved fraction), both in the shipped
preset's row process, a header describing the machine (ISA class, what ``auto`` picks there and
why, checked against the rows measured, and how busy the machine was: ``bench.load``), then
Markdown on stdout, a JSON file with every raw sample and, with matplotlib installed, a PNG plot.

One figure per quantity: a row's seconds per page is its wall time over its pages (pages/min and
the speed-up are that same figure), split into the engine's vision / prefill / decode seconds and
the rest (scheduling, pre- and post-processing, waiting for a CPU); the concurrency table's one
call is the shipped row's own parse when the workload is one page.

The ISA class follows ``cpu.isa_class``: run the benchmark with ``cpu.simulation_env(...)`` set
(e.g. ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``) to measure as a lower class; every row process inherits it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mineru_fast.bench.load import LoadMonitor
from mineru_fast.bench.rows import ROWS, Row
from mineru_fast.bench.startup import run_startup
from mineru_fast.errors import BenchmarkError
from mineru_fast.runtime.hub import PREPARED_CACHE_ENV as CACHE_ENV

SHIPPED = "int8-auto"  # the candidate of the fast preset as shipped: its row also measures concurrency and roofline
TIE_PCT = 5.0  # candidates closer than this (percent of s/page) are a tie in one run


def system_header(threads: int, model: str) -> dict:
    """Machine, software and model identity for the report header."""
    import torch
    import transformers

    from mineru_fast.engine.backends import ipex_status
    from mineru_fast.runtime.choice import CANDIDATES, choose_int8_kernel, choose_preset
    from mineru_fast.runtime.cpu import isa_class, read_topology
    from mineru_fast.runtime.hub import synthetic_identity

    topology = read_topology()
    cls = isa_class(topology.isa)
    preset, kernel = choose_preset(topology), choose_int8_kernel("auto", topology)
    ipex = ipex_status()
    ipex_version = f"{ipex.version} ({'usable' if ipex.usable else ipex.reason})" if ipex.version else ipex.reason
    return {
        "cpu": topology.model,
        "vendor": topology.vendor,
        "physical_cores_available": topology.usable_cores,
        "isa": topology.isa,
        "isa_class": cls.name,
        "hardware_isa_class": cls.hardware,
        "isa_capped_by": cls.capped_by,
        "native_bf16": cls.native_bf16,
        "auto_preset": {"candidate": preset.value, "options": CANDIDATES[preset.value], "reason": preset.reason},
        "int8_kernel_auto": {"kernel": kernel.value, "reason": kernel.reason},
        "numa_nodes": len(topology.nodes),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ipex": ipex_version,
        "threads": threads,
        "model": model,
        "model_identity": synthetic_identity(model) or "checkpoint",
    }


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block (the row processes inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _full_size(model: str) -> bool:
    """Whether ``model``'s vision encoder has MinerU2.5's width (a test model's ratios measure overheads)."""
    from mineru_fast.bench.roofline import VISION_DIM

    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # a hub checkpoint not read here: the real model
    return config.get("vision_config", {}).get("embed_dim") == VISION_DIM


def run_rows(
    rows: list[Row],
    model: str,
    pages: int,
    workload: Path | None,
    threads: int,
    profile: Path | None = None,
    extras: dict | None = None,
) -> list[dict]:
    """Each row in a fresh process, the machine's load measured over each (``row["load"]``);
    failures are recorded, not raised. ``extras`` (``{"concurrency": levels, "roofline": True,
    "phases": True}``)
    go to the spec of the shipped preset's row (``SHIPPED``)."""
    results = []
    for row in rows:
        spec = {"label": row.label, "preset": row.preset, "overrides": row.overrides, "model": model,
                "pages": pages, "workload": str(workload) if workload else None, "threads": threads,
                "profile": str(profile) if profile else None,
                **(extras if extras and row.candidate == SHIPPED and row.instances == 1 else {})}  # fmt: skip
        tag = {"candidate": row.candidate, "preset": row.preset, "overrides": row.overrides}
        print(f"[bench] {row.label} ...", file=sys.stderr, flush=True)
        monitor = LoadMonitor().start()
        result = _run_row(row, spec, tag)
        result["load"] = monitor.stop().to_dict()
        results.append(result)
    return results


def _run_row(row: Row, spec: dict, tag: dict) -> dict:
    if row.instances > 1:
        from mineru_fast.bench.instances import run_instances

        try:
            return {**run_instances(spec, row.instances), **tag}
        except (RuntimeError, ValueError) as exc:
            return {"label": row.label, "error": str(exc)}
    proc = subprocess.run(
        [sys.executable, "-m", "mineru_fast.bench.rows", json.dumps(spec)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"label": row.label, "error": tail[0]}
    result = {**json.loads(proc.stdout.strip().splitlines()[-1]), **tag}
    if row.candidate == SHIPPED:
        result["shipped"] = True
        result["candidate"] = f"int8-{result['numerics']['int8_kernel']}"
    return result


def _numerics_key(row: dict) -> str:
    """Rows with equal weights, activations and kernels give equal logits at batch 1."""
    n = row.get("numerics") or {}
    if n.get("engine") != "fast":
        return ""
    options = {k: row["overrides"].get(k) for k in ("precision", "vision_quant", "lm_quant", "lm_head_quant")}
    return json.dumps([row["preset"], options, n.get("precision"), n.get("int8_kernel")], sort_keys=True)


BENCH_FORCED_STEPS = 200  # real-text fidelity in the benchmark: forced steps per block type (text, table, equation)
BENCH_FREE_BLOCKS = 2  # and free-running blocks per block type


def run_fidelity(rows: list[dict], model: str, workload: Path | None, threads: int) -> dict:
    """Every fast-engine row's numerics against the float32 engine, in one child process
    (``bench.fidelity``); adds ``row["fidelity"]`` in place and returns the run's record
    (``{"page", "requests", "seconds"}``, or ``{"error"}``).

    On a model with a trained language model (``hub.lm_source``) and a real workload
    (``--workload``) it is the real-text comparison (``fidelity.run_content``: content blocks
    teacher-forced with their ground truth, ``BENCH_FORCED_STEPS`` steps and ``BENCH_FREE_BLOCKS``
    free-running blocks per block type; the record then has ``"mode": "content"``); otherwise every
    forced step of the median page."""
    from mineru_fast.bench.fidelity import FP32
    from mineru_fast.runtime.hub import lm_source

    groups: dict[str, list[dict]] = {}
    for row in rows:
        if "error" not in row and _numerics_key(row):
            groups.setdefault(_numerics_key(row), []).append(row)
    not_numerics = ("slots", "page_window", "vision_mode")  # batch 1, eager: these change no logits
    configs = {}
    for i, members in enumerate(groups.values()):
        overrides = {k: v for k, v in members[0]["overrides"].items() if k not in not_numerics}
        configs[f"c{i}"] = {"preset": members[0]["preset"], "overrides": overrides}
    reference = {key for key, config in zip(groups, configs.values(), strict=True) if config == FP32}
    configs = {label: c for label, c in configs.items() if c != FP32}
    spec: dict[str, Any] = {"model": model, "threads": threads, "workload": str(workload) if workload else None,
                            "configs": configs}  # fmt: skip
    content = workload is not None and lm_source(model) is not None
    if content:
        spec.update(mode="content", forced_steps=BENCH_FORCED_STEPS, free_blocks=BENCH_FREE_BLOCKS)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mineru_fast.bench.fidelity", json.dumps(spec)], capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines()[-1:] or ["no output"])[0]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for i, (key, members) in enumerate(groups.items()):
        result = {"reference": True} if key in reference else out["results"].get(f"c{i}")
        if content and result and not result.get("reference"):
            result = _content_cells(result)
        for row in members:
            row["fidelity"] = result
    if content:
        return {"mode": "content", "pages": len(out["pages"]), "requests": out["forced"]["requests"],
                "steps": out["forced"]["steps"], "free_blocks": out["free"]["blocks"],
                "free_tokens": out["free"]["max_new_tokens"], "rules": out["rules"],
                "seconds": time.perf_counter() - start}  # fmt: skip
    return {"page": out["page"], "requests": out["requests"], "seconds": time.perf_counter() - start}


def _content_cells(result: dict) -> dict:
    """A row's real-text figures (``fidelity.run_content``'s result): all steps, confident steps,
    the free-running outputs, and the whole result under ``"detail"``."""
    groups, free = result["forced"]["groups"], result["free"].get("all", {})
    confident = groups.get("confident", {})
    return {"top1_pct": groups["all"]["top1_pct"], "mean_cosine": groups["all"]["mean_cosine"],
            "confident_top1_pct": confident.get("top1_pct"), "free_identical": free.get("identical"),
            "free_blocks": free.get("blocks"), "detail": result}  # fmt: skip


def auto_check(header: dict, rows: list[dict]) -> dict:
    """What ``auto`` picks (from the recorded measurements) against the fastest candidate row of
    this run, and this run's figures as a measurement entry for ``assets/backend_measurements.json``."""
    measured = {r["candidate"]: r["s_per_page"] for r in rows if r.get("candidate") and "error" not in r}
    pick = header["auto_preset"]["candidate"]
    fastest = min(measured, key=measured.__getitem__) if measured else None
    margin = None if pick not in measured or fastest is None else 100 * (measured[pick] / measured[fastest] - 1)
    return {
        "auto_picks": pick,
        "measured_s_per_page": {k: round(v, 1) for k, v in measured.items()},
        "fastest_measured": fastest,
        "agrees": None if pick not in measured else pick == fastest,  # None: auto's pick was not measured
        "pick_slower_pct": margin,  # how much slower auto's pick was than the fastest, percent (0: it was)
        "tie": margin is not None and margin < TIE_PCT,
        "tie_pct": TIE_PCT,
        "entry": {
            "cpu": header["cpu"],
            "vendor": header["vendor"],
            "isa_tier": header["isa_class"],
            "candidates_s": {k: round(v, 1) for k, v in measured.items()},
        },
    }


def summarize(rows: list[dict]) -> None:
    """Add per-row figures in place, all from one measurement, the row's wall time: seconds per page
    (wall / pages), pages/min (60 / that), speed-up (against the first row), the engine's stage
    seconds per page and the rest of the wall time (``other_s_per_page``: scheduling, pre- and
    post-processing, waiting for a CPU; None for pinned instances, which run in parallel), start-up
    and Markdown equality."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    base = ok[0]
    for r in ok:
        pages = len(r["page_seconds"])
        r["s_per_page"] = r["wall_s"] / pages
        r["pages_per_min"] = 60 / r["s_per_page"]
        r["speedup"] = r["pages_per_min"] / base["pages_per_min"]
        r["stage_s_per_page"] = {k: r["timings"].get(k, 0.0) / pages for k in ("vision", "prefill", "decode")}
        parallel = "x" in r["label"] and "core(s)" in r["label"]  # the pinned-instances row
        engine = sum(r["stage_s_per_page"].values())
        r["other_s_per_page"] = None if parallel else max(0.0, r["s_per_page"] - engine)
        r["startup_s"] = r["load_s"] + r["warmup_s"]
        r["markdown_equal_first_row"] = r["markdown"] == base["markdown"]


SPECULATIVE_K = 6  # the draft tokens per step the acceptance table assumes


def speculative_acceptance(model: str, pages: list) -> dict:
    """Speculative decoding's drafts on the workload's replayed requests, per block type
    (``bench.speculative.acceptance_by_type`` with ``SPECULATIVE_K``): model-free, so only
    meaningful on a real workload's ground truth (a synthetic one's filler text repeats itself)."""
    from mineru_fast.bench.fidelity import page_requests
    from mineru_fast.bench.speculative import acceptance_by_type
    from mineru_fast.engine.preprocess import Preprocessor
    from mineru_fast.options import ParserOptions

    options = ParserOptions()
    requests = [
        (kind, r.prompt, r.forced_text or "", r.sampling.max_new_tokens)
        for page in pages
        for kind, r in page_requests(page, options)
    ]
    return {"k": SPECULATIVE_K, "types": acceptance_by_type(requests, Preprocessor(model), SPECULATIVE_K)}


def select_rows(quick: bool, only: list[str] | None) -> tuple[list[Row], list[dict]]:
    """The rows to run and, as ``{"label", "reason"}``, the selected rows this machine cannot run.

    ``only`` given: the rows whose label contains one of its strings (case-insensitive), whatever
    ``quick`` says; otherwise the ``--quick`` rows or all of them.

    Raises:
        BenchmarkError: ``only`` matches no row (the message lists the labels).
    """
    if only:
        wanted = [o.lower() for o in only]
        rows = [r for r in ROWS if any(o in r.label.lower() for o in wanted)]
        if not rows:
            labels = "; ".join(r.label for r in ROWS)
            raise BenchmarkError(f"--only {' / '.join(only)} matches no stage row; the rows are: {labels}")
    else:
        from mineru_fast.runtime.cpu import isa_class, read_topology

        native_bf16 = isa_class(read_topology().isa).native_bf16
        rows = [r for r in ROWS if r.in_quick(native_bf16) or not quick]
    reasons = {r.label: r.unavailable() for r in rows}
    return [r for r in rows if not reasons[r.label]], [
        {"label": r.label, "reason": reasons[r.label]} for r in rows if reasons[r.label]
    ]


def _rows_and_tables(results: dict[str, Any], rows: list[Row], unavailable: list[dict], model: str, pages: int,
                     workload: Path | None, threads: int, profile: Path | None, quick: bool,
                     only: list[str] | None, fidelity: bool | None, out_dir: Path) -> None:  # fmt: skip
    """The stage rows (the shipped one with the concurrency table and roofline unless ``only``), then the
    fidelity run."""
    levels = (1, 2) if quick else (1, 2, 4)
    # --only: none of these sections
    extras = None if only else {"concurrency": list(levels), "roofline": True, "phases": True}
    results["rows"] = run_rows(rows, model, pages, workload, threads, profile, extras)
    summarize(results["rows"])
    shipped = next((r for r in results["rows"] if r.get("shipped") and "error" not in r), None)
    for section in ("concurrency", "roofline", "phases"):
        if shipped is not None and section in shipped:
            results[section] = shipped.pop(section)
    results["extra_rows"] = unavailable
    results["auto_check"] = auto_check(results["header"], results["rows"])
    from mineru_fast.runtime.hub import lm_source

    # on by default in the full run, and in --quick for a model with a trained LM (what it is for)
    if fidelity if fidelity is not None else (not quick or lm_source(model) is not None):
        print("[bench] fidelity vs fp32 ...", file=sys.stderr, flush=True)
        results["fidelity"] = run_fidelity(results["rows"], model, workload, threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1))


def main(model: str | None, quick: bool, pages: int | None, workload: Path | None, threads: int | None,
         out_dir: Path, plot: bool = True, only: list[str] | None = None,
         profile: Path | None = None, fidelity: bool | None = None) -> int:  # fmt: skip
    """Run the benchmark and write ``out_dir/bench.json`` (+ ``bench.png``); returns an exit status.

    ``only``: run just the stage rows whose label contains one of these strings (and neither the
    concurrency table nor the roofline). ``profile``: a page-profile JSON file instead of the
    shipped one (``workload.load_profile``; tests run a page of a few tokens). ``fidelity``:
    compare the rows' logits with the float32 engine (``run_fidelity``; default: in the full run,
    and in ``quick`` for a model with a trained language model; on the full-size model on 2 cores
    the page comparison costs about one float32 page plus one page per distinct configuration).

    Raises:
        BenchmarkError: ``pages`` outside 1..the workload's page count, or ``only`` matching no row.
        ModelLoadError: ``model`` cannot be found.
        TraceError: ``workload`` cannot be read.
    """
    from mineru_fast.bench import report
    from mineru_fast.bench.workload import load_profile, load_workload
    from mineru_fast.runtime.cpu import physical_cores_available
    from mineru_fast.runtime.hub import resolve_model

    threads = threads or physical_cores_available()
    pages = pages or (1 if quick else 4)
    available = len(load_profile(profile))
    if not 1 <= pages <= available:
        raise BenchmarkError(f"--pages must be between 1 and {available} (the workload's pages), got {pages}")
    rows, unavailable = select_rows(quick, only)
    load_workload(pages, workload, profile=profile)  # an unreadable workload fails now, not after the first rows
    if model is not None:
        model = str(resolve_model(model))
    else:  # made in a child process: this one stays small while the rows run
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        from mineru_fast.engine.synthetic import cached_synthetic_model

        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            model = str(pool.submit(cached_synthetic_model, "full").result())
    started, monitor = time.time(), LoadMonitor().start()
    results: dict[str, Any] = {
        "header": {
            **system_header(threads, model),
            "full_size": _full_size(model),
            "quick": quick,
            "pages": pages,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    }
    # One prepared-model cache for this run, made cold by the start-up runs, so the rows (the
    # shipped preset's with its concurrency table) start warm, as every start after a machine's first does.
    with tempfile.TemporaryDirectory(prefix="mineru-fast-bench-prepared-") as prepared:
        if not only:
            print("[bench] start-up: no prepared cache / cold / warm ...", file=sys.stderr, flush=True)
            results["startup"] = run_startup(model, threads, Path(prepared))
        with _environment(CACHE_ENV, prepared):
            _rows_and_tables(results, rows, unavailable, model, pages, workload, threads, profile, quick, only,
                             fidelity, out_dir)  # fmt: skip
    if workload is not None:  # real ground truth: the drafts' acceptance means something
        results["speculative"] = speculative_acceptance(model, load_workload(pages, workload, profile=profile))
    results["header"]["duration_s"] = time.time() - started
    results["load"] = monitor.stop().to_dict()
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1))
    print(report.markdown(results))
    if plot:
        png = report.plot(results, out_dir / "bench.png")
        print(f"\nwrote {out_dir / 'bench.json'}" + (f" and {png}" if png else " (install matplotlib for the plot)"))
    return 0 if all("error" not in r for r in results["rows"]) else 1
