"""The benchmark harness: synthetic workload shape, and a --quick run on the tiny model."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from mineru_fast.bench.workload import load_profile, load_workload, median_first, synthesize
from mineru_fast.protocol.traces import layout_lines


def test_synthetic_pages_have_the_profiled_shape(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for profile in load_profile():
        page = synthesize(profile)
        assert page.image.size == (profile["width"], profile["height"])
        blocks = layout_lines(page.trace.layout)
        assert [b.type for b in blocks] == [b["type"] for b in profile["blocks"]]
        assert [[round(v * 1000) for v in b.bbox] for b in blocks] == [b["bbox"] for b in profile["blocks"]]
        assert abs(len(tokenizer.encode(page.trace.layout)) - profile["layout_tokens"]) <= 2
        for block, content in zip(profile["blocks"], page.trace.contents, strict=True):
            if block["tokens"] is None:
                assert content is None
            else:  # filler outputs reproduce the token count (tables round to whole cells)
                assert abs(len(tokenizer.encode(content)) - block["tokens"]) <= 2, (block, content)


def test_median_page_comes_first():
    profiles = load_profile()
    totals = sorted(p["layout_tokens"] + sum(b["tokens"] or 0 for b in p["blocks"]) for p in profiles)
    first = median_first(profiles)[0]
    total = first["layout_tokens"] + sum(b["tokens"] or 0 for b in first["blocks"])
    assert totals[len(totals) // 2 - 1] <= total <= totals[len(totals) // 2]
    assert [p.name for p in load_workload(2)] == [p["name"] for p in median_first(profiles)[:2]]


@pytest.fixture
def tiny_profile(tmp_path):
    """A one-page workload profile of a few tokens: the harness end to end in seconds (the shipped
    pages replay ~1,500 tokens each, minutes per row on 2 cores)."""
    blocks = [
        {"type": "title", "bbox": [100, 100, 900, 200], "tokens": 4},
        {"type": "text", "bbox": [100, 300, 900, 700], "tokens": 8},
        {"type": "image", "bbox": [100, 750, 500, 950], "tokens": None},
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"pages": [{"name": "tiny", "width": 400, "height": 300, "layout_tokens": 90,
                                           "blocks": blocks}]}))  # fmt: skip
    return path


@pytest.mark.slow
def test_quick_bench_on_the_tiny_model(tiny_model, tiny_profile, tmp_path, capsys):
    from mineru_fast.bench.run import main
    from mineru_fast.runtime.cpu import isa_class, read_topology

    assert main(str(tiny_model), True, 1, None, 2, tmp_path, plot=False, profile=tiny_profile) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    rows = results["rows"]
    cls = isa_class(read_topology().isa)
    baseline = "reference bf16" if cls.native_bf16 else "reference fp32"  # never emulated bf16
    # the shipped preset (vision on per-token oneDNN INT8 where nothing else is recorded, the LM on
    # 32-value blocks), the LM's per-channel A/B and the other kernel
    ab = "  LM INT8 per channel / per token"
    assert [r["label"] for r in rows] == [baseline, "+ continuous batching", ab, "  INT8 per tensor, torch.ao"]
    assert rows[0]["pages"] == ["tiny"] and "data data data data" in rows[0]["markdown"]
    assert [r["candidate"] for r in rows] == [None, "int8-onednn", None, "int8-torch_ao"]
    assert rows[1]["numerics"]["int8_kernel"] == "onednn" and rows[-1]["numerics"]["int8_kernel"] == "torch_ao"
    assert "lm_int8_block" in rows[1]["numerics"]
    # the A/B row: per-channel INT8, its decode rows on the own GEMV where the CPU has one
    assert "lm_int8_block" not in rows[2]["numerics"] and "lm_decode_kernel" in rows[2]["numerics"]
    assert results["header"]["isa_class"] == cls.name
    check = results["auto_check"]
    assert check["auto_picks"] == "int8-onednn" and set(check["measured_s_per_page"]) == {
        "int8-onednn",
        "int8-torch_ao",
    }
    assert check["agrees"] == (check["fastest_measured"] == "int8-onednn")
    assert "fidelity" not in results  # --quick skips it unless asked
    assert all(r["markdown_equal_first_row"] and r["pages_per_min"] > 0 and r["peak_rss_gb"] > 0 for r in rows)
    assert rows[0]["speedup"] == 1.0 and len(rows[0]["page_seconds"]) == 1
    assert [c["concurrency"] for c in results["concurrency"]] == [1, 2]
    assert all(len(c["latencies_s"]) == c["concurrency"] for c in results["concurrency"])
    # one call of the page is the shipped row's own parse: one figure, not two
    assert results["concurrency"][0]["wall_s"] == rows[1]["wall_s"] == rows[1]["s_per_page"]
    assert "concurrency" not in rows[1] and "roofline" not in rows[1]
    assert all(r["load"]["wall_s"] > 0 for r in rows) and results["load"]["cpus"] >= 1
    assert all(v > 0 for v in results["roofline"]["peaks"]["gemm"].values())
    assert 0 < results["roofline"]["fraction"]["decode_batch1_of_bandwidth"]
    assert results["header"]["model_identity"] == "synthetic (random weights, size=tiny, seed=0, version=pro-2605)"
    assert results["roofline"]["full_size"] is False
    # the median page by phase: its layout request, then its crops at once, split by engine stage
    layout, crops = results["phases"]
    assert (layout["phase"], layout["requests"], crops["phase"]) == ("layout pass", 1, "crops, all at once")
    assert crops["requests"] >= 1 and layout["output_tokens"] > 0 and crops["output_tokens"] > 0
    for phase in (layout, crops):
        stages = phase["stages_s"]
        assert phase["errors"] == [] and all(seconds >= 0 for seconds in stages.values())
        assert stages["vision_linears"] > 0 and stages["vision_attention"] > 0 and stages["decode_forward"] > 0
        # the loop's work lies within the phase's wall time (the last step's rest, under a
        # millisecond, may land in the next phase's reading)
        assert sum(stages.values()) <= phase["wall_s"] + 0.05
    assert "phases" not in rows[1]
    out = capsys.readouterr().out
    assert "## Where the median page's time goes" in out and "| crops, all at once (" in out
    assert "## Stage table" in out and f"| {baseline} |" in out and "+ IPEX backend" in out
    assert "- machine load during the run: other processes kept" in out and "auto's pick is the fastest" not in out
    assert "Not a full-size model" in out and "| top-1 vs fp32 % | logits cosine |" in out
    assert "not run | not run" in out and f"ISA class: {cls.name}" in out
    assert "- + continuous batching: fast engine, fp32; onednn: int8 weights per channel" in out
    assert "|   INT8 per token, oneDNN | int8_kernel=auto runs onednn on this class" in out
    # start-up without the prepared cache, cold (writes it) and warm (reads it), each a fresh process
    startup = results["startup"]
    assert [s["prepared_from"] for s in startup] == ["checkpoint", "checkpoint", "cache"]
    assert all(s["load_s"] > 0 and s["warmup_s"] > 0 and s["peak_rss_gb"] > 0 for s in startup)
    assert "| warm (reads the cache) |" in out
    # the rows ran on the warm cache; the shipped preset's memory table: its embedding is mapped
    memory = rows[1]["memory"]
    assert memory["prepared_from"] == "cache" and memory["embedding"]["mapped"]
    assert memory["kv"]["reserved"] > 0 and memory["rss"] > 0 and "lm head (BlockInt8Linear)" in memory["weights"]
    assert "Memory of '+ continuous batching' after its pages" in out


def test_fidelity_runs_once_per_distinct_numerics(monkeypatch):
    """Rows that differ only in batching or vision mode share one comparison; the fp32 rows are
    the reference itself; transformers rows are not replayed step by step."""
    import subprocess

    from mineru_fast.bench import run

    def row(label, preset, overrides, engine="fast", kernel=None):
        return {"label": label, "preset": preset, "overrides": overrides,
                "numerics": {"engine": engine, "precision": "fp32", "int8_kernel": kernel}}  # fmt: skip

    rows = [
        row("ref", "reference-fp32", {}, engine="reference"),
        row("fp32", "exact", {"slots": 1, "lm_quant": "none", "lm_head_quant": "none"}),
        row("int8 single", "fast", {"slots": 1, "page_window": 1}, kernel="onednn"),
        row("int8 batched", "fast", {}, kernel="onednn"),
        row("torch_ao", "fast", {"int8_kernel": "torch_ao"}, kernel="torch_ao"),
    ]
    seen = {}

    def fake(argv, **_):
        seen.update(json.loads(argv[-1])["configs"])
        out = {"page": "p", "requests": 3, "results": {k: {"top1_pct": 99.0 + i} for i, k in enumerate(seen)}}
        return subprocess.CompletedProcess(argv, 0, json.dumps(out), "")

    monkeypatch.setattr(run.subprocess, "run", fake)
    record = run.run_fidelity(rows, "model", None, 1)
    assert list(seen.values()) == [{"preset": "fast", "overrides": {}},
                                   {"preset": "fast", "overrides": {"int8_kernel": "torch_ao"}}]  # fmt: skip
    assert "fidelity" not in rows[0] and rows[1]["fidelity"] == {"reference": True}
    assert rows[2]["fidelity"] == rows[3]["fidelity"] == {"top1_pct": 99.0}
    assert rows[4]["fidelity"] == {"top1_pct": 100.0} and record["requests"] == 3


def test_only_runs_the_selected_rows_and_no_other_section(tiny_model, tiny_profile, tmp_path, capsys):
    from mineru_fast.bench.run import main

    assert main(str(tiny_model), True, 1, None, 1, tmp_path, plot=False, only=["continuous"], profile=tiny_profile) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert [r["label"] for r in results["rows"]] == ["+ continuous batching"]
    assert "concurrency" not in results and "roofline" not in results and "phases" not in results
    out = capsys.readouterr().out
    assert "| + continuous batching |" in out and "## Concurrency" not in out and "## Roofline" not in out


def test_bad_requests_fail_before_any_row_runs(tmp_path):
    from mineru_fast.bench.run import main
    from mineru_fast.errors import BenchmarkError, ModelLoadError, TraceError

    with pytest.raises(BenchmarkError, match="matches no stage row; the rows are: reference fp32;"):
        main(None, True, 1, None, 1, tmp_path, only=["nomatch"])
    with pytest.raises(BenchmarkError, match="between 1 and 14"):
        main(None, True, 15, None, 1, tmp_path)
    with pytest.raises(ModelLoadError):
        main(str(tmp_path / "missing"), True, 1, None, 1, tmp_path)
    with pytest.raises(TraceError):
        main(None, True, 1, tmp_path / "no-workload", 1, tmp_path)
    assert not (tmp_path / "bench.json").exists()


def _row(label="x", wall=346.2, pages=1, timings=None):
    return {"label": label, "page_seconds": [0.0] * pages, "wall_s": wall, "load_s": 1.0, "warmup_s": 0.5,
            "timings": timings or {"vision": 10.1, "prefill": 8.9, "decode": 156.1}, "peak_rss_gb": 1.0,
            "markdown": "same"}  # fmt: skip


def test_one_figure_per_page_quantity():
    """A page's engine seconds (175 s) and its wall time (346 s) are different quantities: the
    table's s/page, pages/min and speed-up are all the wall time's, and the engine's split plus
    "other" add up to it (the old table printed 175.2 s/page beside 0.17 pages/min, i.e. 346 s)."""
    from mineru_fast.bench.report import _stage_table
    from mineru_fast.bench.run import summarize

    rows = [_row("base", wall=535.6, timings={"vision": 7.6, "prefill": 5.3, "decode": 522.5}), _row("fast")]
    summarize(rows)
    fast = rows[1]
    assert fast["s_per_page"] == 346.2 and abs(fast["s_per_page"] * fast["pages_per_min"] - 60) < 1e-9
    assert abs(fast["speedup"] - 535.6 / 346.2) < 1e-9
    assert abs(sum(fast["stage_s_per_page"].values()) + fast["other_s_per_page"] - 346.2) < 1e-9
    line = _stage_table({"rows": rows, "extra_rows": []})[3]
    assert line.startswith("| fast | 346.2 | 0.17 | 1.55x |") and "| 10.1 | 8.9 | 156.1 | 171.1 |" in line
    assert "175.1" not in line and "175.2" not in line  # the engine-only sum is not a second s/page


def test_per_page_split_of_a_multi_page_row():
    from mineru_fast.bench.run import summarize

    rows = [_row(wall=8.0, pages=2, timings={"vision": 4.0, "prefill": 2.0, "decode": 6.0})]
    summarize(rows)
    assert rows[0]["s_per_page"] == 4.0 and rows[0]["stage_s_per_page"] == {
        "vision": 2.0,
        "prefill": 1.0,
        "decode": 3.0,
    }
    assert rows[0]["other_s_per_page"] == 0.0 and rows[0]["pages_per_min"] == 15.0


def test_concurrency_of_one_call_is_the_stage_measurement():
    """With a one-page workload the concurrency table's single call is the stage row's parse, not
    a second measurement of it (which printed 15.3 s beside the row's 2.2 s)."""
    from mineru_fast.bench.rows import concurrency_table

    class Parser:
        calls = 0

        def parse(self, *args, **kwargs):
            Parser.calls += 1

    page = type("Page", (), {"image": None, "trace": None})()
    levels = concurrency_table(Parser(), page, (1, 2), single_s=2.2)
    assert levels[0] == {"concurrency": 1, "wall_s": 2.2, "pages_per_min": 60 / 2.2, "latencies_s": [2.2],
                         "p50_s": 2.2, "p95_s": 2.2, "measured": "stage row"}  # fmt: skip
    assert Parser.calls == 2 and levels[1]["concurrency"] == 2 and len(levels[1]["latencies_s"]) == 2
    assert concurrency_table(Parser(), page, (1,))[0]["measured"] == "here" and Parser.calls == 3


def _header(**extra):
    return {"auto_preset": {"candidate": "int8-onednn", "reason": "recorded"},
            "int8_kernel_auto": {"kernel": "onednn", "reason": "per token"}, **extra}  # fmt: skip


def _check(onednn, torch_ao):
    from mineru_fast.bench.run import auto_check

    rows = [{"candidate": "int8-onednn", "s_per_page": onednn}, {"candidate": "int8-torch_ao", "s_per_page": torch_ao}]
    return auto_check({**_header(), "cpu": "c", "vendor": "v", "isa_class": "avx512"}, rows)


@pytest.mark.parametrize(
    ("onednn", "torch_ao", "idle", "says", "never"),
    [
        (100.0, 120.0, True, "auto's pick (int8-onednn) was the fastest candidate measured here", "slower"),
        (102.0, 100.0, True, "was 2.0% slower than int8-torch_ao in this run: within 5%, a tie in one run", ": NO"),
        (150.0, 100.0, False, "50.0% slower than int8-torch_ao in this run; the machine was busy", "tie"),
        (150.0, 100.0, True, "record this CPU's figures there to change its pick", "busy"),
    ],
)
def test_auto_verdict_says_what_was_measured(onednn, torch_ao, idle, says, never):
    from mineru_fast.bench.report import _auto

    lines = _auto({"header": _header(), "auto_check": _check(onednn, torch_ao), "load": {"idle": idle}})
    verdict = lines[-1]
    assert verdict.startswith(f"- candidates measured here, s/page: int8-onednn {onednn:.1f}, int8-torch_ao")
    assert says in verdict and never not in verdict


def test_load_is_measured_and_a_busy_machine_is_warned_about():
    from mineru_fast.bench.load import LoadReport, describe

    busy = LoadReport(60.0, 2, 1.37, (9.1, 8.0, 7.5), (12.0, 9.0, 8.0)).to_dict()
    assert busy["idle"] is False
    lines = describe(busy)
    assert "other processes kept 1.37 of 2 cores busy on average" in lines[0] and "9.10 / 8.00 / 7.50" in lines[0]
    assert "WARNING: the machine was not idle" in lines[1]
    quiet = describe(LoadReport(60.0, 2, 0.02, (0.1, 0.1, 0.1), (0.2, 0.1, 0.1)).to_dict())
    assert len(quiet) == 1 and "0.02 of 2 cores" in quiet[0]
    assert "not measurable" in describe(LoadReport(1.0, 2, None, (0, 0, 0), (0, 0, 0)).to_dict())[0]


def test_own_children_are_not_other_load():
    """The run's own processes (bench rows, servers) are subtracted from the machine's busy time:
    a child that burns CPU is counted as this run's, live or reaped."""
    import subprocess
    import sys

    from mineru_fast.bench.load import own_cpu_seconds

    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    before = own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn + "print('done', flush=True)\ninput()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "done"
    live = own_cpu_seconds() - before
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait()
    reaped = own_cpu_seconds() - before
    assert live >= 0.4 and reaped >= 0.4


def test_stage_notes_and_each_rows_load():
    from mineru_fast.bench.load import LoadReport
    from mineru_fast.bench.report import _load_cell, _stage_notes

    assert "Not a full-size model" in _stage_notes({"header": {"full_size": False}})[1]
    assert len(_stage_notes({"header": {"full_size": True}})) == 1
    row = {**_row(), "load": LoadReport(10.0, 2, 0.9, (1, 1, 1), (1, 1, 1)).to_dict()}
    assert _load_cell(row) == "0.90 (busy)"
    assert _load_cell({**row, "load": LoadReport(10.0, 2, 0.1, (1, 1, 1), (1, 1, 1)).to_dict()}) == "0.10"


def test_row_selection_and_unavailable_rows():
    from mineru_fast.bench.run import select_rows
    from mineru_fast.engine.backends import ipex_status

    rows, unavailable = select_rows(quick=False, only=["ipex", "pinned"])  # case-insensitive
    labels = [r.label for r in rows] + [u["label"] for u in unavailable]
    assert sorted(labels) == ["+ 2 pinned instances", "+ IPEX backend"]
    assert [r.label for r in select_rows(quick=True, only=["instance"])[0]] == ["+ 2 pinned instances"]
    pair = select_rows(quick=False, only=["continuous batching", "instance"])[0]
    assert [r.label for r in pair] == ["+ continuous batching", "+ 2 pinned instances"]
    status = ipex_status()
    assert ({"label": "+ IPEX backend", "reason": status.reason} in unavailable) == (not status.usable)


@pytest.mark.slow
def test_two_pinned_instances_row_on_the_tiny_model(tiny_model, tiny_profile):
    from mineru_fast.bench.rows import ROWS
    from mineru_fast.bench.run import run_rows, summarize
    from mineru_fast.runtime.cpu import read_topology

    if read_topology().usable_cores < 2:
        pytest.skip("needs 2 usable cores")
    rows = [r for r in ROWS if r.label in ("+ continuous batching", "+ 2 pinned instances")]
    results = run_rows(rows, str(tiny_model), pages=1, workload=None, threads=2, profile=tiny_profile)
    summarize(results)
    single, multi = results
    assert multi["label"] == "+ 2 pinned instances x 1 core(s)"
    assert len(multi["page_seconds"]) == 2 * len(single["page_seconds"]) == 2  # each instance parses the workload
    assert multi["markdown_equal_first_row"] and multi["pages_per_min"] > 0


def test_peak_rss_of_a_row_process_excludes_its_parent():
    """Linux carries a parent's resident size into a forked child's ``ru_maxrss``; a bench row
    must report its own peak. The parent holds 1.5 GB; the child (Python + this package, no
    torch) must report far less, and at least what it allocates itself (200 MB)."""
    import subprocess
    import sys

    from mineru_fast.engine.memory import peak_rss_bytes

    ballast = bytearray(1_500_000_000)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page: resident
    assert peak_rss_bytes() > 1_500_000_000
    code = (
        "from mineru_fast.engine.memory import peak_rss_bytes\n"
        "block = bytearray(200_000_000); block[::4096] = b'\\1' * len(range(0, len(block), 4096))\n"
        "print(peak_rss_bytes())"
    )
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del ballast
    assert 200_000_000 < child < 1_000_000_000


def test_fidelity_on_a_trained_lm_is_the_real_text_run(monkeypatch, tmp_path):
    """A model with a trained LM and a real workload: the content run, its figures per row and the
    four accuracy columns."""
    import subprocess

    from mineru_fast.bench import run
    from mineru_fast.bench.report import _fidelity_notes, _stage_table

    model = tmp_path / "trained"
    model.mkdir()
    (model / "SYNTHETIC.md").write_text("size=tiny, seed=0")
    (model / "LM_SOURCE.json").write_text(json.dumps({"gguf_name": "x", "gguf_file": "x.gguf"}))
    rows = [
        {"label": "fp32", "preset": "exact", "overrides": {"slots": 1, "lm_quant": "none", "lm_head_quant": "none"},
         "numerics": {"engine": "fast", "precision": "fp32", "int8_kernel": None}},
        {"label": "int8", "preset": "fast", "overrides": {}, "numerics": {"engine": "fast", "int8_kernel": "onednn"}},
    ]  # fmt: skip
    seen = {}
    result = {"forced": {"groups": {"all": {"steps": 10, "top1_pct": 95.0, "mean_cosine": 0.999},
                                    "confident": {"steps": 6, "top1_pct": 100.0, "mean_cosine": 0.9995}}},
              "free": {"all": {"blocks": 3, "identical": 2}}}  # fmt: skip

    def fake(argv, **_):
        seen.update(json.loads(argv[-1]))
        out = {"mode": "content", "pages": ["a", "b"], "forced": {"requests": 4, "steps": 10},
               "free": {"blocks": 3, "max_new_tokens": 64}, "results": {"c1": result},
               "rules": {"confident": "p >= 0.5", "image": "56x56"}}  # fmt: skip
        return subprocess.CompletedProcess(argv, 0, json.dumps(out), "")

    monkeypatch.setattr(run.subprocess, "run", fake)
    record = run.run_fidelity(rows, str(model), tmp_path, 1)
    assert seen["mode"] == "content" and seen["forced_steps"] == run.BENCH_FORCED_STEPS
    assert seen["configs"] == {"c1": {"preset": "fast", "overrides": {}}}
    assert record["mode"] == "content" and record["steps"] == 10 and record["free_blocks"] == 3
    assert rows[1]["fidelity"]["confident_top1_pct"] == 100.0 and rows[1]["fidelity"]["free_identical"] == 2
    for row in rows:
        row.update(s_per_page=1.0, stage_s_per_page={"vision": 0.5, "prefill": 0.2, "decode": 0.2},
                   other_s_per_page=0.1, pages_per_min=60.0, speedup=1.0, peak_rss_gb=1.0, startup_s=1.0,
                   markdown_equal_first_row=True)  # fmt: skip
    table = _stage_table({"rows": rows, "extra_rows": [], "fidelity": record})
    assert table[0].endswith("| top-1 vs fp32 % | top-1 confident % | logits cosine | free-run same as fp32 |")
    assert table[2].endswith("| fp32 itself | fp32 itself | fp32 itself | fp32 itself |")
    assert table[3].endswith("| yes | 95.00 | 100.00 | 0.99900 | 2/3 |")
    assert "10 teacher-forced steps of 4 content blocks" in _fidelity_notes({"fidelity": {**record, "seconds": 6}})[0]
