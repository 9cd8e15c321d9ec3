"""Bounded-time fuzz run of ``DocumentParser.parse`` on mutated PDFs and images (tiny model).

Mutations of small documents made here and of the shared corpus's files (``../shared/corpus``
beside the clone, or ``--corpus``; skipped when absent), see ``tests/fuzzing.py``. Every input
goes through ``parse`` with small generation bounds; a typed ``InputError`` is a fine outcome,
anything else escaping is a finding, and an input that runs longer than ``--hang-seconds`` is a
hang (the run then dumps every thread's stack and exits). Input ``i`` is reproducible:
``mutate(seeds, random.Random(i))`` with the same seeds.

    python benchmarks/fuzz_inputs.py [--seconds 600] [--model DIR] [--corpus DIR] [--hang-seconds 120]

Prints the inputs tried, the wall time, the outcome counts and each finding; exits 1 on a finding.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fuzzing import check_parse, corpus_seeds, made_seeds, mutate  # noqa: E402

BOUNDS = {"layout": 8, "text": 8, "table": 8, "equation": 8}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="time budget (default: %(default)s)")
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny synthetic model, made now)")
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--max-seed-mb", type=float, default=3.0, help="largest corpus file used (default: %(default)s)")
    ap.add_argument("--hang-seconds", type=float, default=120.0, help="one input longer than this is a hang")
    ap.add_argument("--first", type=int, default=0, help="number of the first input (default: 0)")
    args = ap.parse_args()

    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.engine.synthetic import make_synthetic_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_synthetic_model(Path(tmp) / "tiny", size="tiny", seed=0)
        options = ParserOptions.preset("exact", max_new_tokens=BOUNDS, max_side=1024)
        parser = DocumentParser.from_pretrained(model, options)
        seeds = {**made_seeds(), **corpus_seeds(args.corpus, int(args.max_seed_mb * 1024 * 1024))}
        print(f"[fuzz] {len(seeds)} seeds: {', '.join(sorted(seeds))}", flush=True)
        outcomes: collections.Counter[str] = collections.Counter()
        findings: list[str] = []
        start = time.monotonic()
        number = args.first
        while time.monotonic() - start < args.seconds:
            description, data = mutate(seeds, random.Random(number))
            faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
            try:
                outcomes[check_parse(parser, data)] += 1
            except Exception as exc:
                outcomes["finding"] += 1
                findings.append(f"input {number} ({description}): {type(exc).__name__}: {exc}")
                traceback.print_exc()
            finally:
                faulthandler.cancel_dump_traceback_later()
            number += 1
        seconds = time.monotonic() - start
    tried = number - args.first
    print(f"[fuzz] {tried} inputs in {seconds:.0f} s ({tried / seconds:.1f}/s); outcomes: {dict(outcomes)}")
    for finding in findings:
        print(f"[fuzz] FINDING {finding}")
    print(f"[fuzz] {len(findings)} findings, 0 hangs")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
