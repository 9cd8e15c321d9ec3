"""The per-channel INT8 linears of the vision encoder with their activations quantized by the own
one-pass kernel (``kernels.kernel_status().quantize_tokens``) against PyTorch's operators (four
passes over the input: max, min, a scaled add into a float32 copy, the uint8 conversion), the same
outputs bit for bit (checked on every call pair).

``python benchmarks/token_quantize.py --model DIR [--threads 2] [--rows 5476 1024] [--repeat 5]
[--rounds 2] [--json OUT]``

The fast preset's engine is built from ``--model`` and its first vision block's four linears run
on ``--rows`` random rows (5,476: a layout image's patches; 1,024: a crop's), the two ways
alternated ``--rounds`` times in one process, each the fastest of ``--repeat`` calls. ``qkv`` runs
as the encoder runs it (its row groups, one quantization). Measure on an idle machine; under
``runtime.cpu.simulation_env`` caps to see a lower class.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from mineru_fast.bench.roofline import best_seconds


def _key(sample: dict) -> tuple:
    return sample["round"], sample["rows"], sample["linear"], sample["way"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (full size for real figures)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[5476, 1024])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    import mineru_fast.engine.quantize as quantize
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.kernels import kernel_status
    from mineru_fast.options import ParserOptions

    status = kernel_status()
    if status.quantize_tokens is None:
        raise SystemExit(f"no own token quantization here: {status.reason}")
    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads), prepared_cache=False)
    block = engine.vision.blocks[0]
    linears = {name: getattr(block, name) for name in ("qkv", "proj", "fc1", "fc2")}
    kinds = [type(m).__name__ for m in linears.values()]
    if not all(isinstance(m, quantize.OneDnnInt8Linear) for m in linears.values()):
        raise SystemExit(f"the vision linears are not per-channel INT8 here: {kinds}")
    ways = {"own kernel": status, "PyTorch's operators": replace(status, quantize_tokens=None)}

    def call(name: str, x: torch.Tensor) -> list[torch.Tensor]:
        layer = linears[name]
        if name == "qkv" and layer.row_groups is not None:
            return [y.clone() for y in layer.row_group_outputs(x)]
        return [layer(x)]

    rows_out = []
    original = quantize.kernel_status
    try:
        with torch.inference_mode():
            for round_ in range(args.rounds):
                for rows in args.rows:
                    torch.manual_seed(rows)
                    for name, layer in linears.items():
                        x = torch.randn(rows, layer.in_features)
                        outputs = {}
                        for way, way_status in ways.items():
                            quantize.kernel_status = lambda s=way_status: s  # type: ignore[assignment]
                            outputs[way] = call(name, x)
                            seconds = best_seconds(lambda n=name, v=x: call(n, v), args.repeat)
                            sample = {"round": round_, "rows": rows, "linear": name, "way": way}
                            rows_out.append({**sample, "ms": seconds * 1e3})
                        first, second = outputs.values()
                        if not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)):
                            raise SystemExit(f"{name} at {rows} rows: the two ways' outputs differ")
    finally:
        quantize.kernel_status = original  # type: ignore[assignment]

    print(f"{args.threads} threads, fastest of {args.repeat} calls; ms per call (own kernel / PyTorch's operators)")
    print("| round | rows | " + " | ".join(linears) + " | the block's four | ratio |")
    print("|---|---|" + "---|" * (len(linears) + 2))
    for round_ in range(args.rounds):
        for rows in args.rows:
            cells, totals = [], dict.fromkeys(ways, 0.0)
            for name in linears:
                key = (round_, rows, name)
                own, ops = (next(r["ms"] for r in rows_out if _key(r) == (*key, w)) for w in ways)
                totals["own kernel"] += own
                totals["PyTorch's operators"] += ops
                cells.append(f"{own:.1f} / {ops:.1f}")
            own_total, ops_total = totals.values()
            print(
                f"| {round_ + 1} | {rows} | " + " | ".join(cells) + f" | {own_total:.1f} / {ops_total:.1f} | "
                f"{own_total / ops_total:.3f} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
