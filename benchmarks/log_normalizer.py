"""The decode loop's log-normalizer (the ``logsumexp`` behind every chosen token's log-probability):
``torch.logsumexp`` against ``engine.sampling.log_normalizer`` (no denormal terms), in one process.

The fast preset's engine on ``--model`` decodes ``--batch`` sizes of forced requests (the same
text for all, so every step is that wide); the scheduler's normalizer is swapped between the two
forms, alternated, ``--reps`` times; printed: milliseconds per decode step of each run. The tokens
and log-probabilities are the same either way (``tests/test_sampling.py`` checks the bits).

``python benchmarks/log_normalizer.py --model DIR [--threads 2] [--batch 1 16] [--reps 3] [--json OUT]``.
Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

import mineru_fast.engine.scheduler as scheduler_module
from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.factory import build_engine
from mineru_fast.engine.sampling import log_normalizer
from mineru_fast.options import ParserOptions
from mineru_fast.protocol.spec import prompt_for, sampling_for

FORMS = {"torch.logsumexp": lambda logits: torch.logsumexp(logits, dim=-1), "log_normalizer": log_normalizer}
TEXT = " ".join(f"word{i}" for i in range(400))  # forced: 120 new tokens of it
NEW_TOKENS = 120


def step_ms(engine, batch: int) -> float:
    """Milliseconds per decode step while all ``batch`` sequences decode (the loop stepped here)."""
    from PIL import Image

    scheduler = engine.scheduler
    sampling = replace(sampling_for("text"), max_new_tokens=NEW_TOKENS)
    for i in range(batch):  # images differ by a column, so each request is its own
        image = Image.new("RGB", (300 + i, 120), "white")
        scheduler.submit(GenerationRequest(image, prompt_for("text"), sampling, forced_text=TEXT), start=False)
    with torch.inference_mode():
        while len(scheduler.live) < batch:
            scheduler.step()
        start, steps = time.perf_counter(), 0
        while len(scheduler.live) == batch:
            scheduler.step()
            steps += 1
        seconds = (time.perf_counter() - start) / steps
        while scheduler.has_work():
            scheduler.step()
    return seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (full size for real figures)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    options = ParserOptions.preset("fast", threads=args.threads, slots=max(args.batch))
    engine = build_engine(args.model, options, prepared_cache=True)
    torch.set_num_threads(engine.scheduler.threads)
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in FORMS}
    try:
        for _ in range(args.reps):
            for name, form in FORMS.items():
                scheduler_module.log_normalizer = form  # type: ignore[assignment]
                for batch in args.batch:
                    figures[name].setdefault(f"batch {batch}", []).append(round(step_ms(engine, batch), 2))
    finally:
        scheduler_module.log_normalizer = log_normalizer
        engine.close()
    for name, rows in figures.items():
        print(name, "; ".join(f"{b}: {v} ms/step" for b, v in rows.items()))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "ms_per_step": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
