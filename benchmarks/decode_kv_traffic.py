"""How much of a batched decode step is the KV cache's memory traffic: the fast preset's language
model stepping ``--batch`` rows at each ``--context``, once with a slot per row (every row's keys and
values read from memory: ``batch x context x 24 layers x 2 x 128`` float32 values, 590 MB at 16 x
1,500) and once with every row on one shared slot (the same arithmetic over one slot's keys and
values, which stay in the caches). The difference bounds what a smaller KV cache (bfloat16, u8)
could save on a step; the step at a short context, what the attention costs at all.

``python benchmarks/decode_kv_traffic.py --model DIR [--threads 2] [--batch 16] [--context 41 1500]
[--repeat 10] [--rounds 2] [--json OUT]``

Fastest of ``--repeat`` steps, the two ways alternated ``--rounds`` times in one process. The rows
of a shared slot all write the same position (one value, written ``batch`` times): only the reads
differ. Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mineru_fast.bench.roofline import best_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (full size for real figures)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, nargs="+", default=[41, 1500])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from mineru_fast.engine.factory import build_engine
    from mineru_fast.options import ParserOptions

    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads), prepared_cache=False)
    lm = engine.lm
    ways = {"a slot per row": torch.arange(args.batch), "one shared slot": torch.zeros(args.batch, dtype=torch.long)}
    rows = []
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for context in args.context:
                tokens, positions = torch.zeros(args.batch, dtype=torch.long), torch.full((args.batch,), context)
                for way, slots in ways.items():
                    seconds = best_seconds(lambda t=tokens, p=positions, s=slots: lm.decode(t, p, p, s), args.repeat)
                    rows.append({"round": round_, "context": context, "way": way, "step_ms": seconds * 1000})
    print(f"batch {args.batch}, {args.threads} threads, fastest of {args.repeat} steps")
    print("| round | context | " + " | ".join(f"{way}, ms" for way in ways) + " |")
    print("|---|---|" + "---|" * len(ways))
    for round_ in range(args.rounds):
        for context in args.context:
            cells = [f"{r['step_ms']:.1f}" for r in rows if r["round"] == round_ and r["context"] == context]
            print(f"| {round_ + 1} | {context} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "batch": args.batch, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
