"""The prefill's MLP in chunks of ``model.MLP_CHUNK_ROWS`` rows against one call over a whole
prefill chunk, swapped in one process and alternated: the fast preset's language model on the
full-size model, ``--chunks`` prompt chunks of ``--tokens`` tokens (the engine's prefill chunk:
512), seconds per chunk and whether the logits are bit-identical.

A whole 512-row chunk's ``w_gate_up`` output (19 MiB) is over the mmap threshold the engine pins
(``engine.memory.MMAP_THRESHOLD_BYTES``), so glibc maps it afresh at every layer and the kernel
faults and zeroes its pages; 96 rows stay under it and are reused from the heap.

    python benchmarks/prefill_mlp_chunks.py --model DIR [--threads 2] [--tokens 512] [--chunks 3]
        [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mineru_fast.bench.report import print_json
from mineru_fast.engine import model as lm_model
from mineru_fast.engine.factory import build_engine
from mineru_fast.options import ParserOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads))
    lm, chunked_rows = engine.lm, lm_model.MLP_CHUNK_ROWS
    embeds = torch.randn(1, args.tokens, lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.tokens).view(1, 1, -1).expand(3, 1, -1).contiguous()
    sides = {"whole chunk": args.tokens, f"{chunked_rows}-row MLP calls": chunked_rows}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    logits = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for side, rows in sides.items():
                lm_model.MLP_CHUNK_ROWS = rows
                start = time.perf_counter()
                for _ in range(args.chunks):
                    logits[side] = lm.prefill(embeds, positions, 0)
                seconds[side].append((time.perf_counter() - start) / args.chunks)
    lm_model.MLP_CHUNK_ROWS = chunked_rows
    whole, chunked = (min(seconds[s]) for s in sides)
    result = {
        "threads": args.threads,
        "tokens": args.tokens,
        "seconds_per_chunk": seconds,
        "ratio_fastest": chunked / whole,
        "logits_bit_identical": torch.equal(*logits.values()),
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
