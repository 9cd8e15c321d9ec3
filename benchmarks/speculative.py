"""Speculative decoding on against off (issue 46): decode steps per output token and wall time.

The model's choices are the replay trace's real tokens (the OmniDocBench demo pages' ground-truth
layout and block texts, forced), the drafts are what ``engine.speculative.DraftProposer`` gives for
them, and every forward pass runs on ``--model`` (the fast preset's engine), so the cost is the real
model's. Random weights' own text is never used.

Timed, each request set run with speculative decoding off and on (once per ``--rows`` value of
the scheduler's ``speculative_rows``), alternated, ``--reps`` times (fastest kept; the stages'
seconds too):

- ``longest_table``: the workload's longest table block alone (batch 1);
- ``median_page``: the median page's layout request, then its content requests all at once (as
  ``DocumentParser`` sends them);
- ``batch16``: 16 content requests of the workload at once (the scheduler gives no drafts to a step
  already ``speculative_rows`` wide, so this checks that speculation costs a full batch nothing).

``row_cost``: one decode step of R rows of one sequence (a token and R - 1 drafts) at 500 positions of
context, R = 1, 2, 3, 5, 9, 17 (``Qwen2LM.decode``, fastest of 12): what a draft token costs.

Model-free, ``acceptance``: every request of every workload page replayed through the proposer
alone (forced tokens decide acceptance, so this is the engine's count at batch 1): draft tokens
proposed and accepted, and decode steps per output token, per block type.

A dense text page of a born-digital PDF with its text-layer drafts is not measured: the real model's
text for such a page is not available here (no weights), and forcing the text layer itself as the
"model output" would accept every draft by construction.

``python benchmarks/speculative.py --model DIR --workload ../shared/workloads/omnidocbench_demo
[--threads 2] [--speculative 6] [--rows 4,8] [--reps 1] [--items ...] [--json OUT]``. Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from mineru_fast.bench.report import print_json
from mineru_fast.bench.speculative import acceptance_by_type
from mineru_fast.bench.workload import load_workload
from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.factory import build_engine
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.page import plan_content, read_layout
from mineru_fast.protocol.spec import layout_image, prompt_for


def page_requests(page, options: ParserOptions) -> tuple[GenerationRequest, list[tuple[str, GenerationRequest]]]:
    """A workload page's replayed layout request and its (block type, content request) pairs."""
    layout = GenerationRequest(
        layout_image(page.image), prompt_for("layout"), options.sampling("layout", replayed=True), page.trace.layout
    )
    blocks = read_layout(page.trace.layout)
    contents = []
    for request in plan_content(page.image, blocks, image_analysis=False):
        forced = page.trace.content_for(blocks.blocks[request.block_index])
        if forced is not None:
            sampling = options.sampling(request.task, replayed=True)
            contents.append((request.task, GenerationRequest(request.image, request.prompt, sampling, forced)))
    return layout, contents


def row_cost(engine, context: int = 500) -> dict[int, float]:
    """Milliseconds of one decode step of R rows of one slot at ``context`` positions (fastest of 12)."""
    lm = engine.lm
    out = {}
    with torch.inference_mode():
        prompt = lm.embed_tokens(torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0)))
        lm.prefill_chunks([(prompt, torch.arange(context).expand(3, -1), 0, 0)])
        for rows in (1, 2, 3, 5, 9, 17):
            tokens = torch.randint(0, 1000, (rows,), generator=torch.Generator().manual_seed(rows))
            positions = torch.arange(context, context + rows)
            slots = torch.zeros(rows, dtype=torch.long)
            best = float("inf")
            for _ in range(12):
                start = time.perf_counter()
                lm.decode(tokens, positions, positions, slots)
                best = min(best, time.perf_counter() - start)
            out[rows] = 1e3 * best
            print(f"row_cost {rows} rows: {out[rows]:.1f} ms", flush=True)
    return out


def timed(engine, requests: list[GenerationRequest]) -> dict:
    """One ``generate`` of ``requests``: wall seconds, output tokens, decode steps, drafts."""
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    for r in results:
        if r.finish_reason != "stop":
            raise RuntimeError(f"a replayed request ended {r.finish_reason}: {r.error}")
    return {
        "seconds": seconds,
        "tokens": sum(len(r.token_ids) for r in results),
        "decode_steps": sum(r.decode_steps for r in results),
        "draft_tokens": sum(r.draft_tokens for r in results),
        "accepted_tokens": sum(r.accepted_tokens for r in results),
        "token_ids": [r.token_ids for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--workload", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speculative", type=int, default=6)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument(
        "--rows", type=lambda t: [int(v) for v in t.split(",")], default=[8], help="speculative_rows values, e.g. 4,8"
    )
    ap.add_argument("--items", default="acceptance,row_cost,longest_table,median_page,batch16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    items = args.items.split(",")
    torch.set_num_threads(args.threads)
    options = ParserOptions.preset("fast", threads=args.threads)
    pages = load_workload(workload_dir=args.workload)
    report: dict = {"speculative": args.speculative, "threads": args.threads, "model": args.model.name}
    engine = build_engine(args.model, options)
    tokenize = engine.preprocessor.forced_ids
    if "acceptance" in items:
        everything = [("layout", page_requests(p, options)[0]) for p in pages]
        everything += [pair for p in pages for pair in page_requests(p, options)[1]]
        triples = [(kind, r.prompt, r.forced_text or "", r.sampling.max_new_tokens) for kind, r in everything]
        report["acceptance"] = acceptance_by_type(triples, engine.preprocessor, args.speculative)
        print(json.dumps(report["acceptance"], indent=1), flush=True)
    if "row_cost" in items:
        report["row_cost_ms"] = row_cost(engine)
    tables = [(r, len(tokenize(r.forced_text or ""))) for p in pages for kind, r in page_requests(p, options)[1]
              if kind == "table"]  # fmt: skip
    longest = max(tables, key=lambda rt: rt[1])[0]
    median_layout, median_contents = page_requests(pages[0], options)
    crops = [r for p in pages for _, r in page_requests(p, options)[1]][:16]
    sets = {
        "longest_table": [[longest]],
        "median_page": [[median_layout], [r for _, r in median_contents]],
        "batch16": [crops],
    }
    engine.generate([longest])  # warm-up
    modes = [("off", 0, 0)] + [(f"on_rows{rows}", args.speculative, rows) for rows in args.rows]
    for name, stages in sets.items():
        if name not in items:
            continue
        runs: dict[str, list[dict]] = {mode: [] for mode, _, _ in modes}
        for _ in range(args.reps):
            for mode, k, rows in modes:
                engine.scheduler.speculative_rows = rows
                parts = [timed(engine, [dataclasses.replace(r, speculative=k) for r in stage]) for stage in stages]
                run = {key: sum(p[key] for p in parts) for key in ("seconds", "tokens", "decode_steps",
                                                                    "draft_tokens", "accepted_tokens")}  # fmt: skip
                run["stage_seconds"] = [p["seconds"] for p in parts]
                run["token_ids"] = [ids for p in parts for ids in p["token_ids"]]
                runs[mode].append(run)
                print(name, mode, {k: v for k, v in run.items() if k != "token_ids"}, flush=True)
        best = {mode: min(runs[mode], key=lambda r: r["seconds"]) for mode in runs}
        for mode, run in best.items():
            if run["token_ids"] != best["off"]["token_ids"]:
                raise RuntimeError(f"{name}: speculative decoding ({mode}) changed the tokens")
        report[name] = {mode: {k: v for k, v in run.items() if k != "token_ids"} for mode, run in best.items()}
        for mode in best:
            report[name][mode]["wall_ratio_to_off"] = best[mode]["seconds"] / best["off"]["seconds"]
    engine.close()
    print_json(report, args.json)


if __name__ == "__main__":
    main()
