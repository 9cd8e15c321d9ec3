"""The vision encoder's per-channel INT8 linears on the own AVX2 GEMM (``kernels.per_channel_gemm_status``,
the avx2 class) against oneDNN's GEMM and the rescale pass after it, the same outputs bit for bit
(checked on every call pair).

``python benchmarks/per_channel_gemm.py --model DIR [--threads 2] [--rows 5476 1024] [--repeat 5]
[--rounds 2] [--encoder-reps 0] [--json OUT]``

The fast preset's engine is built from ``--model``; its first vision block's four linears run as
built (the own GEMM) and as a copy packed for oneDNN, on ``--rows`` random rows (5,476: a layout
image's patches; 1,024: a crop's), the two alternated ``--rounds`` times in one process, each the
fastest of ``--repeat`` calls, each run as the encoder runs it: ``qkv`` by its row groups from one
quantization, ``fc1`` and ``fc2`` on ``vision.MLP_CHUNK_ROWS`` rows at a time. With
``--encoder-reps R``, the whole vision encoder then runs a layout image (74 x 74 patches) R times
each way, alternated, after an untimed pass of each, every per-channel linear of it on the own GEMM
or on oneDNN (the same outputs bit for bit, checked). Run it on an AVX2 CPU, or under
``runtime.cpu.simulation_env("avx2")``'s caps (a simulation: the caps lower oneDNN to its AVX2 code
and the CPU class to avx2); measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mineru_fast.bench.roofline import best_seconds

WAYS = ("own GEMM", "oneDNN")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (full size for real figures)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[5476, 1024])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--encoder-reps", type=int, default=0, help="layout-image encoder passes per way")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    import mineru_fast.engine.quantize as quantize
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.engine.kernels import GemmStatus, per_channel_gemm_status
    from mineru_fast.engine.vision import MLP_CHUNK_ROWS
    from mineru_fast.options import ParserOptions

    status = per_channel_gemm_status()
    if status.gemm is None:
        raise SystemExit(f"the own per-channel GEMM does not run here: {status.reason}")
    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads), prepared_cache=False)
    block = engine.vision.blocks[0]
    own = {name: getattr(block, name) for name in ("qkv", "proj", "fc1", "fc2")}
    if not all(isinstance(m, quantize.OneDnnInt8Linear) and m.own_gemm for m in own.values()):
        raise SystemExit(f"the vision linears do not run the own GEMM: {[type(m).__name__ for m in own.values()]}")
    # every per-channel linear of the encoder (the block's four among them), with its oneDNN twin
    places = [
        (parent, name, child)
        for parent in engine.vision.modules()
        for name, child in parent.named_children()
        if isinstance(child, quantize.OneDnnInt8Linear)
    ]
    original = quantize.per_channel_gemm_status
    quantize.per_channel_gemm_status = lambda: GemmStatus(None, "oneDNN")  # type: ignore[assignment]
    try:
        twins = {id(child): quantize.OneDnnInt8Linear.from_prepared(child.prepared_state()) for _, _, child in places}
    finally:
        quantize.per_channel_gemm_status = original  # type: ignore[assignment]
    onednn = {name: twins[id(m)] for name, m in own.items()}

    def call(layer: quantize.OneDnnInt8Linear, x: torch.Tensor) -> list[torch.Tensor]:
        if layer.row_groups is not None:
            return [y.clone() for y in layer.row_group_outputs(x)]
        if layer in (own["fc1"], own["fc2"], onednn["fc1"], onednn["fc2"]):
            return [layer(x[start : start + MLP_CHUNK_ROWS]) for start in range(0, x.shape[0], MLP_CHUNK_ROWS)]
        return [layer(x)]

    samples = []
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for rows in args.rows:
                torch.manual_seed(rows)
                for name in own:
                    x = torch.randn(rows, own[name].in_features)
                    outputs = {}
                    for way, layer in zip(WAYS, (own[name], onednn[name]), strict=True):
                        outputs[way] = call(layer, x)
                        seconds = best_seconds(lambda f=layer, v=x: call(f, v), args.repeat)
                        samples.append({"round": round_, "rows": rows, "linear": name, "way": way, "ms": seconds * 1e3})
                    if not all(torch.equal(a, b) for a, b in zip(*outputs.values(), strict=True)):
                        raise SystemExit(f"{name} at {rows} rows: the own GEMM's outputs differ from oneDNN's")

    encoder: dict[str, list[float]] = {way: [] for way in WAYS}
    if args.encoder_reps:
        grid = (1, 74, 74)
        patches = torch.randn(74 * 74, engine.vision.config.patch_dim, generator=torch.Generator().manual_seed(0))
        results = {}
        with torch.inference_mode():
            for rep in range(args.encoder_reps + 1):  # the first pass of each way untimed (first-call costs)
                for way in WAYS:
                    for parent, name, child in places:
                        setattr(parent, name, child if way == WAYS[0] else twins[id(child)])
                    start = time.perf_counter()
                    results[way] = engine.vision(patches, [grid])
                    if rep:
                        encoder[way].append(time.perf_counter() - start)
        if not torch.equal(*results.values()):
            raise SystemExit("the encoder's outputs differ between the own GEMM and oneDNN")

    def ms(round_: int, rows: int, name: str, way: str) -> float:
        key = (round_, rows, name, way)
        return next(s["ms"] for s in samples if (s["round"], s["rows"], s["linear"], s["way"]) == key)

    print(f"{args.threads} threads, fastest of {args.repeat} calls; ms per call (own GEMM / oneDNN)")
    print("| round | rows | " + " | ".join(own) + " | the block's four | ratio |")
    print("|---|---|" + "---|" * (len(own) + 2))
    for round_ in range(args.rounds):
        for rows in args.rows:
            pairs = [(ms(round_, rows, name, WAYS[0]), ms(round_, rows, name, WAYS[1])) for name in own]
            total_own, total_onednn = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
            cells = " | ".join(f"{a:.1f} / {b:.1f}" for a, b in pairs)
            print(
                f"| {round_ + 1} | {rows} | {cells} | {total_own:.1f} / {total_onednn:.1f} | "
                f"{total_own / total_onednn:.3f} |"
            )
    if args.encoder_reps:
        own_s, onednn_s = (encoder[way] for way in WAYS)
        print(f"the encoder's layout pass (74 x 74 patches), alternated, s: own GEMM {own_s}, oneDNN {onednn_s}")
        print(f"fastest: {min(own_s):.2f} / {min(onednn_s):.2f} s = {min(own_s) / min(onednn_s):.3f}")
    if args.json:
        figures = {"threads": args.threads, "samples": samples, "encoder_seconds": encoder}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
