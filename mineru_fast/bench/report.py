"""Benchmark output: Markdown tables, a script's JSON and an optional matplotlib plot, from measured results only."""

from __future__ import annotations

import json
from pathlib import Path

from mineru_fast.bench.load import describe


def _content(results: dict) -> bool:
    """Whether the fidelity run was the real-text one (``bench.fidelity.run_content``)."""
    return (results.get("fidelity") or {}).get("mode") == "content"


def _fidelity_cells(r: dict, ran: bool, content: bool = False) -> str:
    f = r.get("fidelity")
    width = 4 if content else 2
    if f and f.get("reference"):
        return " | ".join(["fp32 itself"] * width)
    if f and content:
        confident = "n/a" if f["confident_top1_pct"] is None else f"{f['confident_top1_pct']:.2f}"
        same = f"{f['free_identical']}/{f['free_blocks']}" if f.get("free_blocks") else "n/a"
        return f"{f['top1_pct']:.2f} | {confident} | {f['mean_cosine']:.5f} | {same}"
    if f:
        return f"{f['top1_pct']:.2f} | {f['mean_cosine']:.5f}"
    if not ran:
        return " | ".join(["not run"] * width)
    return " | ".join(["n/a"] * width)  # transformers engine rows, pinned instances: not replayed step by step


def _load_cell(r: dict) -> str:
    other = (r.get("load") or {}).get("other_cores")
    if other is None:
        return "?"
    return f"{other:.2f}" + (" (busy)" if r["load"]["idle"] is False else "")


def _stage_table(results: dict) -> list[str]:
    ran, content = "fidelity" in results, _content(results)
    accuracy = (
        "top-1 vs fp32 % | top-1 confident % | logits cosine | free-run same as fp32"
        if content
        else "top-1 vs fp32 % | logits cosine"
    )
    columns = 16 if content else 14
    lines = [
        "| stage | s/page | pages/min | speed-up | peak RSS GB | start-up s | vision s/page | prefill s/page "
        f"| decode s/page | other s/page | others' load, cores | same Markdown | {accuracy} |",
        "|" + "---|" * columns,
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " |" * (columns - 2))
            continue
        t, other = r["stage_s_per_page"], r["other_s_per_page"]
        lines.append(
            f"| {r['label']} | {r['s_per_page']:.1f} | {r['pages_per_min']:.2f} | {r['speedup']:.2f}x "
            f"| {r['peak_rss_gb']:.2f} | {r['startup_s']:.1f} | {t['vision']:.1f} | {t['prefill']:.1f} "
            f"| {t['decode']:.1f} | {'n/a' if other is None else f'{other:.1f}'} | {_load_cell(r)} "
            f"| {'yes' if r['markdown_equal_first_row'] else 'NO'} | {_fidelity_cells(r, ran, content)} |"
        )
    for r in results["extra_rows"]:
        lines.append(f"| {r['label']} | {r['reason']} |" + " |" * (columns - 2))
    return lines


def _stage_notes(results: dict) -> list[str]:
    notes = [
        "- s/page is each row's wall time over its pages, the one figure behind pages/min and the speed-up; "
        "vision / prefill / decode are the engine's seconds in them, other is the rest (scheduling, pre- and "
        "post-processing, waiting for a CPU)",
    ]
    if not results["header"].get("full_size", True):
        notes.append(
            "- **Not a full-size model**: its layers are tiny, so its times and speed-ups measure per-call "
            "overheads (Python, scheduling, kernel launches), not what MinerU2.5 costs; run on the full-size "
            "model (the default) for figures to compare"
        )
    return notes


def _kernel_paths(results: dict) -> list[str]:
    lines = ["Kernel path of each row (weights; activations; kernel):", ""]
    for r in results["rows"]:
        n = r.get("numerics") or {}
        if "error" in r or not n:
            continue
        bf16 = f" ({n['bf16']} bf16)" if n.get("bf16") else ""
        int8 = n.get("int8_kernel_path") or "no per-token INT8 layers"
        decode = f"; LM block-wise INT8: {n['lm_int8_block']}" if n.get("lm_int8_block") else ""
        decode += f"; LM decode rows: {n['lm_decode_kernel']}" if n.get("lm_decode_kernel") else ""
        lines.append(f"- {r['label']}: {n['engine']} engine, {n['precision']}{bf16}; {int8}{decode}")
    return lines


def _fidelity_notes(results: dict) -> list[str]:
    f = results.get("fidelity")
    if f is None:
        return ["- top-1 / cosine: not run (--quick skips them unless the model has a trained LM; pass --fidelity)"]
    if "error" in f:
        return [f"- top-1 / cosine: the fidelity run failed: {f['error']}"]
    if f.get("mode") == "content":
        rules = f["rules"]
        return [
            f"- top-1 vs fp32 / logits cosine: real text on the trained language model: {f['steps']} teacher-forced "
            f"steps of {f['requests']} content blocks (text, tables as OTSL, formulas as LaTeX) from {f['pages']} "
            f"workload pages, {rules['image']}, batch 1; top-1 confident: steps where {rules['confident']}; "
            f"free-run same: greedy outputs (protocol rules, <= {f['free_tokens']} new tokens) identical to fp32's, "
            f"of {f['free_blocks']} blocks (bench/fidelity.py; {f['seconds'] / 60:.1f} min)"
        ]
    return [
        f"- top-1 vs fp32 / logits cosine: every forced step of page {f['page']} ({f['requests']} requests: "
        "layout + crops) at batch 1 with teacher forcing, each row's logits against the float32 engine's "
        f"(bench/fidelity.py; {f['seconds'] / 60:.1f} min)"
    ]


def _auto(results: dict) -> list[str]:
    h, check = results["header"], results.get("auto_check") or {}
    lines = [
        f"- auto preset picks {h['auto_preset']['candidate']}: {h['auto_preset']['reason']}",
        f"- int8_kernel=auto (the fast preset) runs {h['int8_kernel_auto']['kernel']}: "
        f"{h['int8_kernel_auto']['reason']}",
    ]
    measured = check.get("measured_s_per_page") or {}
    figures = ", ".join(f"{k} {v:.1f}" for k, v in measured.items()) or "none"
    pick, fastest, margin = check.get("auto_picks"), check.get("fastest_measured"), check.get("pick_slower_pct")
    if check.get("agrees") is None:
        verdict = f"auto's pick ({pick}) was not among the rows run here, so this run does not check it"
    elif check["agrees"]:
        verdict = f"auto's pick ({pick}) was the fastest candidate measured here"
    else:
        verdict = f"auto's pick ({pick}) was {margin:.1f}% slower than {fastest} in this run"
        if check.get("tie"):
            verdict += f": within {check['tie_pct']:.0f}%, a tie in one run"
        busy = (results.get("load") or {}).get("idle") is False
        verdict += (
            "; the machine was busy, so this run cannot overturn the recorded measurements auto follows"
            if busy
            else "; auto follows the recorded measurements (assets/backend_measurements.json): record this "
            "CPU's figures there to change its pick"
        )
    lines.append(f"- candidates measured here, s/page: {figures}; {verdict}")
    return lines


def _concurrency(levels: list[dict]) -> list[str]:
    reused = any(c.get("measured") == "stage row" for c in levels)
    return [
        "## Concurrency (one fast-preset parser, N concurrent parse calls of the median page)",
        "",
        *(
            [
                "Measured in the '+ continuous batching' row's process; 1 call is that row's own parse "
                "(the same figure).",
                "",
            ]
            if reused
            else []
        ),
        "| concurrent calls | pages/min | P50 s | P95 s |",
        "|---|---|---|---|",
        *[f"| {c['concurrency']} | {c['pages_per_min']:.2f} | {c['p50_s']:.1f} | {c['p95_s']:.1f} |" for c in levels],
    ]


def _roofline(rf: dict) -> list[str]:
    g, a, f = rf["peaks"]["gemm"], rf["achieved"], rf["fraction"]
    kind = rf.get("vision_attention", "fp32 SDPA")  # reports written before the own kernel: SDPA
    peak = "bf16" if kind == "own bf16" else "fp32"
    caveat = (
        []
        if rf["full_size"]
        else [
            "- Not a full-size model: peaks and achieved figures use its small shapes, which measure",
            "  call overheads more than this CPU's ceilings; the fractions below are not efficiencies.",
            "",
        ]
    )
    return [
        "## Roofline (measured on this CPU)",
        "",
        *caveat,
        "- GEMM peaks (best of 5476x1280 @ 1280x5120 and 5476x5120 @ 5120x1280): "
        f"fp32 {g['fp32']:.0f} GFLOP/s, bf16 {g['bf16']:.0f} GFLOP/s, int8 {g['int8']:.0f} GOP/s; "
        f"memory bandwidth {rf['peaks']['memory_gbps']:.1f} GB/s",
        "",
        "| part (fast preset) | achieved | of peak |",
        "|---|---|---|",
        f"| vision linears (int8) | {a['vision_linears_gops']:.0f} GOP/s "
        f"| {f['vision_linears_of_int8_peak']:.0%} of int8 |",
        f"| vision attention ({kind}, N=5476) | {a['vision_attention_gflops']:.0f} GFLOP/s "
        f"| {f[f'vision_attention_of_{peak}_peak']:.0%} of {peak} |",
        f"| decode, batch 1 ({a['decode_batch1_ms']:.1f} ms/step) | {a['decode_batch1_gbps']:.1f} GB/s of weights "
        f"| {f['decode_batch1_of_bandwidth']:.0%} of bandwidth |",
    ]


PHASE_COLUMNS = (  # (stage of FastEngine.stage_seconds, column heading)
    ("vision_linears", "vision linears"),
    ("vision_attention", "vision attention"),
    ("vision_other", "vision other"),
    ("prefill", "prefill"),
    ("decode_forward", "decode forward"),
    ("decode_other", "decode other (rules, sampling, drafts)"),
    ("idle", "loop idle"),
)


def phases_table(phases: list[dict]) -> list[str]:
    """The shipped row's median page by phase and engine stage (``rows.phase_breakdown``)."""
    heads = " | ".join(title for _, title in PHASE_COLUMNS)
    lines = [
        "## Where the median page's time goes (shipped preset, engine stages, seconds)",
        "",
        f"| phase | wall | {heads} | loop other |",
        "|---|---|" + "---|" * (len(PHASE_COLUMNS) + 1),
    ]
    for p in phases:
        cells = " | ".join(f"{p['stages_s'][stage]:.2f}" for stage, _ in PHASE_COLUMNS)
        requests = f"{p['requests']} request{'s' * (p['requests'] != 1)}"
        lines.append(f"| {p['phase']} ({requests}, {p['output_tokens']} tokens) | {p['wall_s']:.2f} "
                     f"| {cells} | {p['loop_other_s']:.2f} |")  # fmt: skip
    lines += [
        "",
        "- vision other: norms, activations, residual additions, the patch embedding, the merger and"
        " the pack's pixels and outputs; loop other: the loop's own work between units and time its"
        " thread waited for a CPU.",
        *[f"- {p['phase']}: failed request: {error}" for p in phases for error in p["errors"]],
    ]
    return lines


def _startup(rows: list[dict]) -> list[str]:
    lines = [
        "Start-up of the fast preset, each case a fresh process (load + warm-up; see `bench.startup`):",
        "",
        "| case | load s | warm-up s | start-up s | prepared from | peak RSS GB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['load_s']:.1f} | {r['warmup_s']:.1f} | {r['load_s'] + r['warmup_s']:.1f} "
            f"| {r['prepared_from']} | {r['peak_rss_gb']:.2f} |"
        )
    return lines


def _memory(results: dict) -> list[str]:
    """Where the shipped fast preset's memory is after its pages (the '+ continuous batching' row)."""
    row = next((r for r in results["rows"] if r.get("candidate") and r.get("memory") and not r["overrides"]), None)
    if row is None:
        return []
    m = row["memory"]

    def mb(value: int | None) -> str:
        return "?" if value is None else f"{value / 1e6:.0f}"

    e, kv = m["embedding"], m["kv"]
    lines = [
        f"Memory of '{row['label']}' after its pages (MB; model {m['prepared_from']}):",
        "",
        "| part | MB |",
        "|---|---|",
        *[f"| {part} | {mb(size)} |" for part, size in m["weights"].items()],
        f"| embedding ({e['dtype']}, {'memory-mapped' if e['mapped'] else 'in memory'}): resident of "
        f"{mb(e['bytes'])} | {mb(e['resident'])} |",
        f"| KV buffers: committed of {mb(kv['reserved'])} reserved | {mb(kv['committed'])} |",
        f"| other (runtime, tokenizer, activations, allocator) | {mb(m['other'])} |",
        f"| resident now / peak | {mb(m['rss'])} / {mb(m['peak_rss'])} |",
    ]
    return lines


def print_json(result: dict, path: Path | None = None) -> None:
    """Print ``result`` as indented JSON (a benchmark script's output) and, with ``path``, write the
    same text there, newline-terminated."""
    text = json.dumps(result, indent=1)
    print(text)
    if path is not None:
        path.write_text(text + "\n")


def markdown(results: dict) -> str:
    """All tables as Markdown."""
    h = results["header"]
    isa = ", ".join(flag for flag, present in h["isa"].items() if present) or "none of the tracked flags"
    capped = ", ".join(f"{k}={v}" for k, v in h["isa_capped_by"].items())
    isa_class = h["isa_class"] + (
        f" (simulated: hardware {h['hardware_isa_class']}, capped by {capped})" if capped else ""
    )
    lines = [
        f"# mineru-fast bench{' (--quick: few pages, key rows only)' if h['quick'] else ''}",
        "",
        f"- CPU: {h['cpu']}; {h['physical_cores_available']} physical cores available; NUMA nodes: {h['numa_nodes']}",
        f"- ISA: {isa}",
        f"- ISA class: {isa_class}; bf16 {'native' if h['native_bf16'] else 'emulated'}",
        f"- Python {h['python']}, torch {h['torch']}, transformers {h['transformers']}, IPEX {h['ipex']}",
        f"- threads: {h['threads']}; model: {h['model']} ({h['model_identity']}); pages: {h['pages']} (replayed)",
        f"- started: {h['date']}; duration: {h['duration_s'] / 60:.1f} min",
        *(describe(results["load"]) if "load" in results else []),
        *(
            [
                "- rows are cumulative; --quick runs the first (baseline) and the shipped fast preset"
                " ('+ continuous batching': every optimization above it in the full table)"
            ]
            if h["quick"]
            else []
        ),
        "",
        "## Stage table",
        "",
        *_stage_table(results),
        "",
        *_stage_notes(results),
        *_fidelity_notes(results),
        *_auto(results),
        "",
        *_kernel_paths(results),
    ]
    if "startup" in results:
        lines += ["", *_startup(results["startup"])]
    if memory := _memory(results):
        lines += ["", *memory]
    if "concurrency" in results:
        lines += ["", *_concurrency(results["concurrency"])]
    if "phases" in results:
        lines += ["", *phases_table(results["phases"])]
    if "roofline" in results:
        lines += ["", *_roofline(results["roofline"])]
    if "speculative" in results:
        lines += ["", *_speculative(results["speculative"])]
    return "\n".join(lines)


def _speculative(section: dict) -> list[str]:
    """The drafts' acceptance per block type (``run.speculative_acceptance``)."""
    lines = [
        f"## Speculative decoding: drafts on the replayed workload (k = {section['k']}, batch 1, model-free)",
        "",
        "| block type | output tokens | decode steps plain | with drafts | drafts proposed | accepted | acceptance |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, g in section["types"].items():
        lines.append(
            f"| {kind} | {g['tokens']} | {g['plain_steps']} | {g['decode_steps']} ({g['steps_ratio']:.2f}x) | "
            f"{g['proposed']} | {g['accepted']} | {100 * g['acceptance']:.0f} % |"
        )
    return lines


def plot(results: dict, path: Path) -> Path | None:
    """Speed-up by stage and the vision/prefill/decode split as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results["rows"] if "error" not in r]
    labels = [r["label"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.barh(labels, [r["speedup"] for r in rows], color="tab:blue")
    left.set_xlabel("speed-up vs first row (pages/min)")
    left.invert_yaxis()
    bottom = [0.0] * len(rows)
    for stage, color in (
        ("vision", "tab:orange"),
        ("prefill", "tab:green"),
        ("decode", "tab:red"),
        ("other", "tab:gray"),
    ):
        values = [(r["other_s_per_page"] or 0.0) if stage == "other" else r["stage_s_per_page"][stage] for r in rows]
        right.barh(labels, values, left=bottom, color=color, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_xlabel("seconds per page")
    right.invert_yaxis()
    right.legend()
    h = results["header"]
    fig.suptitle(
        f"mineru-fast bench: {h['cpu']}, {h['threads']} threads, {h['pages']} page(s), {h['model_identity']}, "
        f"torch {h['torch']}, {h['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
