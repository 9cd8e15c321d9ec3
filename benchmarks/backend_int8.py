"""One INT8 linear of the vision encoder's MLP shape: torch.ao's dynamic INT8 (the stock backend)
against IPEX's INT8 linear. Prints the ``int8_linear_ms`` figures of a
``mineru_fast/assets/backend_measurements.json`` entry for this CPU.

Run in an environment with the ``ipex`` extra:
``python benchmarks/backend_int8.py [--rows 512] [--threads N] [--repeat 10]``
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from torch import nn

from mineru_fast.engine.backends import ipex_int8_linear, isa_tier, load_ipex
from mineru_fast.engine.quantize import Int8DynamicConfig, quantize_
from mineru_fast.runtime.cpu import read_topology


def milliseconds(module: nn.Module, x: torch.Tensor, repeat: int) -> float:
    """Median wall time of ``module(x)`` in ms after one warm-up call."""
    times = []
    with torch.inference_mode():
        module(x)
        for _ in range(repeat):
            start = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="tokens (patches) per call")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_ipex()
    torch.manual_seed(0)
    linear = nn.Linear(1280, 5120).eval()  # the vision MLP's first linear (MinerU2.5-2509)
    x = torch.randn(args.rows, 1280)
    stock = quantize_(nn.Sequential(copy.deepcopy(linear)), Int8DynamicConfig())
    theirs = ipex_int8_linear(copy.deepcopy(linear))
    topo = read_topology()
    figures = {"stock": milliseconds(stock, x, args.repeat), "ipex": milliseconds(theirs, x, args.repeat)}
    print(json.dumps({"cpu": topo.model, "vendor": topo.vendor, "isa_tier": isa_tier(topo),
                      "threads": args.threads, "rows": args.rows, "int8_linear_ms": figures}))  # fmt: skip


if __name__ == "__main__":
    main()
