"""What a second OpenMP pool costs the engine's thread (see ``mineru_fast.runtime.threads``).

    python benchmarks/openmp_pools.py [--model DIR] [--threads N] [--tokens T]

Loads a parser (the build leaves the calling thread without an OpenMP pool), then decodes the same
replayed text request of ``--tokens`` tokens through the engine three times: with the engine
thread's pool the only one, after the main thread has run multi-threaded GEMMs for a few seconds
(its pool then lives as long as the process), and once more. Prints the decode seconds of each
run and the ratio. Default model: a tiny synthetic one (made here); the effect shows best on the
full-size model, whose decode step is many short parallel ops.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()

    import torch
    from PIL import Image

    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.engine.base import GenerationRequest
    from mineru_fast.engine.synthetic import make_synthetic_model
    from mineru_fast.protocol.spec import SamplingParams, prompt_for

    model = args.model or make_synthetic_model(Path(tempfile.mkdtemp()) / "tiny", size="tiny", seed=0)
    parser = DocumentParser.from_pretrained(model, ParserOptions.preset("fast", threads=args.threads))
    text = " ".join(str(i) for i in range(args.tokens))  # about two tokens a number: cut by the bound
    request = GenerationRequest(
        Image.new("RGB", (448, 112), "white"), prompt_for("text"),
        SamplingParams(max_new_tokens=args.tokens, min_new_tokens=args.tokens), forced_text=text,
    )  # fmt: skip

    def decode_seconds() -> float:
        result = parser.engine.submit(request).result()
        return result.decode_s

    decode_seconds()  # warm-up
    alone = decode_seconds()
    a, w = torch.randn(256, 1280), torch.randn(1280, 1280)
    start = time.perf_counter()
    while time.perf_counter() - start < 3.0:  # the main thread's pool, busy for a while
        (a @ w).relu_()
    beside = [decode_seconds(), decode_seconds()]
    parser.close()
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "decode_s_alone": alone,
                      "decode_s_beside_main_pool": beside, "ratio": min(beside) / alone}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
