"""The Python around a batch-1 decode step's kernels: the fast preset's language model on the
full-size model, one row at ``--context`` positions, two ways in one process, alternated step by
step:

- ``pytorch ops``: the decoder layers one by one from Python, the kernels' calls (block linears,
  decode attention) between PyTorch's norms, SiLU and residual adds (~300 calls a step: the fast
  preset before 2026-12-05's one-call step);
- ``one call``: the whole decoder in one call of the extension (``kernels.BoundDecoder``; its norms
  and SiLU-gated product in the kernels' arithmetic, a few float32 ulps from PyTorch's).

The largest difference of the two ways' logits (relative to their largest magnitude) is printed too.

    python benchmarks/decode_call_overhead.py --model DIR [--threads 2] [--context 41 1500]
        [--steps 200] [--json OUT]

Prints one JSON object: per context, each way's ms per step (median, 10th percentile, fastest) and
the ratio of the medians (one call over pytorch ops). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from mineru_fast.bench.report import print_json
from mineru_fast.engine import kernels
from mineru_fast.engine.factory import build_engine
from mineru_fast.options import ParserOptions

WAYS = ("pytorch ops", "one call")


def summary(seconds: list[float]) -> dict[str, float]:
    """Milliseconds per step: median, 10th percentile, fastest."""
    ordered = sorted(seconds)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p10_ms": ordered[len(ordered) // 10] * 1e3,
        "fastest_ms": ordered[0] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, nargs="+", default=[41, 1500])
    parser.add_argument("--steps", type=int, default=200, help="steps per way and context")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder = kernels.kernel_status().decoder
    if decoder is None:
        raise SystemExit(f"the decoder kernels do not run here: {kernels.kernel_status().reason}")
    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads))
    lm, token = engine.lm, torch.zeros(1, dtype=torch.long)

    def use(way: str) -> None:
        lm.use_decoder_kernels(None if way == "pytorch ops" else decoder)

    result: dict = {"threads": args.threads, "contexts": {}}
    try:
        with torch.inference_mode():
            for context in args.context:
                position = torch.tensor([context])
                logits = {}
                for way in WAYS:
                    use(way)
                    logits[way] = lm.decode(token, position, position)
                scale = logits["pytorch ops"].abs().max()
                difference = float((logits["one call"] - logits["pytorch ops"]).abs().max() / scale)
                seconds: dict[str, list[float]] = {way: [] for way in WAYS}
                for step in range(args.steps):
                    for way in WAYS if step % 2 == 0 else WAYS[::-1]:
                        use(way)
                        start = time.perf_counter()
                        lm.decode(token, position, position)
                        seconds[way].append(time.perf_counter() - start)
                figures: dict = {way: summary(values) for way, values in seconds.items()}
                figures["median_ratio"] = statistics.median(seconds["one call"]) / statistics.median(
                    seconds["pytorch ops"]
                )
                figures["logits_max_relative_difference"] = difference
                result["contexts"][str(context)] = figures
    finally:
        engine.close()
    print_json(result, args.json)


if __name__ == "__main__":
    main()
