"""The vision encoder's attention: the own bfloat16 kernel against PyTorch's float32 SDPA.

Two measurements, side by side in one run:
1. attention alone at a layout image's shape (5,476 patches, head size 80, the 2 heads the encoder
   gives each call and all 16), best of 3: ms and GFLOP/s (4 n^2 d per head);
2. the full-size synthetic model's vision encoder on a layout image (74 x 74 patches), INT8 linears
   as the fast preset runs them, with each attention (alternated, best of ``--reps``), and the
   cosine of its output against the float32-attention one.

Usage: ``python benchmarks/vision_attention.py [--threads 2] [--reps 2] [--model DIR]``; the
synthetic model is made (about 1 min) where ``--model`` is not given. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from mineru_fast.engine.generate import FastEngine
from mineru_fast.engine.kernels import attention_status
from mineru_fast.engine.quantize import Int8DynamicConfig
from mineru_fast.engine.synthetic import cached_synthetic_model
from mineru_fast.runtime.choice import choose_int8_kernel
from mineru_fast.runtime.cpu import read_topology

N, HEAD_DIM, HEADS = 5476, 80, 16
GRID = (1, 74, 74)


def best(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_alone(kernel) -> dict:
    out: dict = {}
    for heads in (2, HEADS):
        q, k, v = (torch.randn(heads, N, HEAD_DIM) for _ in range(3))
        rows = torch.empty(N, heads * HEAD_DIM)
        flop = 4 * N * N * HEAD_DIM * heads
        sdpa = best(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q[None], k[None], v[None]))
        own = best(lambda q=q, k=k, v=v, rows=rows: kernel(q, k, v, rows))
        out[f"{heads}_heads"] = {
            "sdpa_fp32_ms": sdpa * 1e3,
            "own_bf16_ms": own * 1e3,
            "sdpa_fp32_gflops": flop / sdpa / 1e9,
            "own_bf16_gflops": flop / own / 1e9,
            "speedup": sdpa / own,
        }
    return out


def layout_pass(model, reps: int) -> dict:
    kernel = choose_int8_kernel("auto", read_topology()).value
    engines = {
        name: FastEngine(
            model, slots=1, max_seq_len=4096, vision_attention=name, vision_quant=Int8DynamicConfig(kernel)
        )
        for name in ("fp32", "bf16")
    }
    patches = torch.randn(N, engines["fp32"].vision.config.patch_dim, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    with torch.inference_mode():
        for name, engine in engines.items():  # warm-up: the prepacked weights, the allocator
            outputs[name] = engine.vision(patches, [GRID])
        for _ in range(reps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.vision(patches, [GRID])
                times[name].append(time.perf_counter() - start)
    a, b = outputs["fp32"].flatten(), outputs["bf16"].flatten()
    return {
        "int8_kernel": kernel,
        "seconds": {name: min(t) for name, t in times.items()},
        "ratio_bf16_to_fp32": min(times["bf16"]) / min(times["fp32"]),
        "cosine_vs_fp32_attention": F.cosine_similarity(a, b, dim=0).item(),
        "reasons": {name: e.vision_attention_reason for name, e in engines.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--model", help="a full-size checkpoint (default: the synthetic one, made once)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    status = attention_status()
    if status.attention is None:
        raise SystemExit(f"the own attention does not run here: {status.reason}")
    model = args.model or cached_synthetic_model("full", seed=0)
    result = {"threads": args.threads, "attention": attention_alone(status.attention)}
    result["layout_vision_pass"] = layout_pass(model, args.reps)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
