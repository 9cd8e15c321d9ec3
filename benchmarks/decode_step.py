"""Where the time of one batch-1 decode step goes (issue 27): weights read against this machine's
bandwidth, and a per-operator profile of the step.

For the fast engine on ``--model`` (the fast preset by default), at each ``--context`` length:

- the step's wall time (fastest of ``--repeat`` steps after a warm-up);
- the bytes of weights it reads (every LM linear plus the LM head, at the engine's weight width)
  over that time, against the copy bandwidth ``bench.roofline.memory_bandwidth`` measures here:
  the time a step could take if it only streamed its weights;
- the step's linears alone (every layer's and the head, one row each, called back to back): the
  matrix products' share, whichever kernel runs them;
- a ``torch.profiler`` table of one step's operators grouped by role (the matrix products that are
  PyTorch operators, decode attention, everything else), and the time spent outside any operator
  (Python, dispatch, and the own kernels, which are no PyTorch operators).

``python benchmarks/decode_step.py --model DIR [--threads 2] [--context 100 1500] [--lm-quant Q] [--json OUT]``
(``--lm-quant``: the language model's and head's quantization instead of the preset's, e.g.
``int8-dynamic`` for per-channel INT8 against the fast preset's 32-value blocks).

Measure on an idle machine: another process on the cores changes every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mineru_fast.bench.roofline import best_seconds

GEMM_OPS = {
    "onednn::qlinear_pointwise",
    "mineru_fast::int8_linear_rows",
    "mineru_fast::int8_block_linear",
    "aten::_int_mm",
    "aten::addmm",
    "aten::mm",
    "aten::linear",
}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"}
# (the own decode attention, csrc/decode_attention_avx512.cpp, is no operator: "outside operators")


def _step_seconds(lm, context: int, repeat: int) -> float:
    tokens = torch.zeros(1, dtype=torch.long)
    position = torch.tensor([context])
    return best_seconds(lambda: lm.decode(tokens, position, position), repeat)


def _linears_ms(lm, repeat: int) -> float:
    """Milliseconds of one step's linears (every layer's and the head) called back to back on one
    row each, outside the model: what the step costs in matrix products, whichever kernel runs
    them (the own kernels are no PyTorch operators, so the profiler does not see them)."""
    linears = [m for m in lm.modules() if hasattr(m, "in_features") and not list(m.children())]
    rows = [torch.randn(1, 1, m.in_features, dtype=lm.dtype) for m in linears]

    def run() -> None:
        for layer, x in zip(linears, rows, strict=True):
            layer(x)

    return best_seconds(run, repeat) * 1000


def _profile(lm, context: int, steps: int = 5) -> dict[str, float]:
    """Milliseconds per step by role: ``gemm``, ``attention``, ``other_ops`` and ``outside_ops``
    (the step's wall time under the profiler minus every operator's own time)."""
    from torch.profiler import profile

    tokens = torch.zeros(1, dtype=torch.long)
    position = torch.tensor([context])
    lm.decode(tokens, position, position)
    with profile() as prof:  # the profiler's own start and stop outside the timed steps
        start = time.perf_counter()
        for _ in range(steps):
            lm.decode(tokens, position, position)
        wall_ms = (time.perf_counter() - start) * 1000 / steps
    roles = {"gemm": 0.0, "attention": 0.0, "other_ops": 0.0}
    operators = 0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / steps
        role = "gemm" if event.key in GEMM_OPS else "attention" if event.key in ATTENTION_OPS else "other_ops"
        roles[role] += ms
        operators += event.count
    roles["outside_ops"] = max(0.0, wall_ms - sum(roles.values()))
    roles["operators_per_step"] = operators / steps
    return roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (full size for real figures)")
    parser.add_argument("--preset", default="fast")
    parser.add_argument("--lm-quant", help="lm_quant and lm_head_quant instead of the preset's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, nargs="+", default=[100, 1500])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from mineru_fast.bench.roofline import lm_weight_count, memory_bandwidth
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.options import ParserOptions

    quant = {"lm_quant": args.lm_quant, "lm_head_quant": args.lm_quant} if args.lm_quant else {}
    options = ParserOptions.preset(args.preset, threads=args.threads, **quant)
    engine = build_engine(args.model, options, prepared_cache=False)
    lm = engine.lm
    per_weight = {"int8-dynamic": 1.0, "int8-weight-only": 1.0, "int8-block": 1.125}  # block: + a float32 scale per 32
    bytes_per_weight = per_weight.get(options.lm_quant, engine.dtype.itemsize)
    weight_bytes = lm_weight_count(lm.config) * bytes_per_weight
    with torch.inference_mode():
        bandwidth = memory_bandwidth()
        rows = []
        for context in args.context:
            seconds = _step_seconds(lm, context, args.repeat)
            rows.append({"context": context, "step_ms": seconds * 1000, **_profile(lm, context)})
        linears_ms = _linears_ms(lm, args.repeat)
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1000
    print(f"weights read per step: {weight_bytes / 1e6:.0f} MB; copy bandwidth {bandwidth:.1f} GB/s; "
          f"streaming them alone takes {floor_ms:.1f} ms; the step's linears alone took {linears_ms:.1f} ms "
          f"({weight_bytes / linears_ms / 1e6:.1f} GB/s)")  # fmt: skip
    print("| context | step ms | GB/s of weights | matrix products ms | attention ms | other operators ms "
          "| outside operators ms | operators/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["context"], f"{r['step_ms']:.1f}", f"{weight_bytes / r['step_ms'] / 1e6:.1f}"]
        cells += [f"{r[key]:.1f}" for key in ("gemm", "attention", "other_ops", "outside_ops")]
        cells.append(f"{r['operators_per_step']:.0f}")
        print("| " + " | ".join(map(str, cells)) + " |")
    print("(operator times are the profiler's, which adds its own cost to each; the step ms is without it)")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "threads": args.threads,
                                         "weight_bytes": weight_bytes, "copy_bandwidth_gbps": bandwidth,
                                         "linears_ms": linears_ms, "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
