"""What a second OpenMP pool costs the engine's thread (see ``mineru_fast.threads``).

    python benchmarks/openmp_pools.py [--threads N] [--repeats R]

Runs the same torch work (an MLP-shaped mix of GEMMs and elementwise ops, ``[256, 1280]`` rows)
in a new thread twice: first while no other thread of the process has an OpenMP pool, then after
the main thread has run one parallel op (so its pool exists, as it did when the engine was loaded
in the caller's thread). Prints both times and their ratio. The run alone can only come first
(the main thread's pool lasts as long as the process); run the script twice to see the drift
between runs, which should be well under the effect.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def work(steps: int) -> float:
    """Seconds for ``steps`` rounds of ``[256, 1280] @ [1280, 1280]`` + bias + ReLU."""
    a, w = torch.randn(256, 1280), torch.randn(1280, 1280)
    start = time.perf_counter()
    for _ in range(steps):
        (a @ w).add_(1.0).relu_()
    return time.perf_counter() - start


def in_thread(threads: int, steps: int) -> float:
    out: list[float] = []

    def run() -> None:
        torch.set_num_threads(threads)
        out.append(work(steps))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    alone = [in_thread(args.threads, args.steps)]  # before the main thread has any pool
    torch.ones(4_000_000).add(1.0)  # the main thread's pool now exists, for the rest of the process
    beside = [in_thread(args.threads, args.steps) for _ in range(args.repeats)]
    result = {"threads": args.threads, "steps": args.steps, "alone_s": alone, "beside_main_pool_s": beside,
              "ratio": min(beside) / alone[0]}  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
