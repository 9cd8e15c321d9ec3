"""The vision encoder's attention: the own kernels and PyTorch's bfloat16 SDPA against its float32 SDPA.

The own kernels are those this CPU runs: ``own_bf16`` (AVX-512 BF16) and ``own_f32`` (AVX2 + FMA).
Two measurements, side by side in one run:
1. attention alone at a layout image's shape (5,476 patches, head size 80, the 2 heads the encoder
   gives each call and all 16), the attentions alternated call by call, best of 3: ms and GFLOP/s
   (4 n^2 d per head) of float32 SDPA, bfloat16 SDPA (``kernels.sdpa_bf16_attention``: what the AMX
   class runs; only where the CPU class has native bfloat16) and each own kernel;
2. the full-size synthetic model's vision encoder on a layout image (74 x 74 patches), INT8 linears
   as the fast preset runs them, with float32 attention (``fp32``), with the fast preset's attention
   on this CPU class (``bf16``, the option's value: ``kernels.vision_attention_status``) and with
   each own kernel that is not that one (alternated, best of ``--reps``), and the cosine of each
   output against the float32-attention one.

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
from mineru_fast.engine.kernels import (
    F32_ATTENTION,
    Attention,
    attention_status,
    f32_attention_kernel,
    sdpa_bf16_attention,
    vision_attention_status,
)
from mineru_fast.engine.quantize import Int8DynamicConfig
from mineru_fast.engine.synthetic import cached_synthetic_model
from mineru_fast.runtime.choice import choose_int8_kernel
from mineru_fast.runtime.cpu import isa_class, read_topology

N, HEAD_DIM, HEADS = 5476, 80, 16
GRID = (1, 74, 74)


def own_kernels() -> dict[str, Attention]:
    """The own attention kernels this CPU runs, by name (``own_bf16``, ``own_f32``)."""
    found = {}
    if attention_status().attention is not None:
        found["own_bf16"] = attention_status().attention
    try:
        found["own_f32"] = f32_attention_kernel()
    except (ImportError, ValueError):  # no kernels built, or no AVX2
        pass
    return found


def attention_alone(kernels: dict[str, Attention]) -> dict:
    out: dict = {}
    for heads in (2, HEADS):
        q, k, v = (torch.randn(heads, N, HEAD_DIM) for _ in range(3))
        rows = torch.empty(N, heads * HEAD_DIM)
        flop = 4 * N * N * HEAD_DIM * heads
        calls = {"sdpa_fp32": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q[None], k[None], v[None])}
        if isa_class(read_topology().isa).native_bf16:
            calls["sdpa_bf16"] = lambda q=q, k=k, v=v, rows=rows: sdpa_bf16_attention(q, k, v, rows)
        for name, kernel in kernels.items():
            calls[name] = lambda q=q, k=k, v=v, rows=rows, kernel=kernel: kernel(q, k, v, rows)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():  # warm-up
            call()
        for _ in range(3):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        fastest = {name: min(t) for name, t in times.items()}
        out[f"{heads}_heads"] = {
            **{f"{name}_ms": t * 1e3 for name, t in fastest.items()},
            **{f"{name}_gflops": flop / t / 1e9 for name, t in fastest.items()},
            **{f"speedup_{name}": fastest["sdpa_fp32"] / t for name, t in fastest.items() if name != "sdpa_fp32"},
        }
    return out


def layout_pass(model, reps: int, kernels: dict[str, Attention]) -> dict:
    kernel = choose_int8_kernel("auto", read_topology()).value
    engines = {
        name: FastEngine(
            model, slots=1, max_seq_len=4096, vision_attention=name, vision_quant=Int8DynamicConfig(kernel)
        )
        for name in ("fp32", "bf16")
    }
    fast = vision_attention_status().reason
    reasons = {"own_bf16": attention_status().reason, "own_f32": F32_ATTENTION}
    for name, own in kernels.items():
        if reasons[name] == fast:  # the fast preset's engine runs it already
            continue
        engines[name] = FastEngine(
            model, slots=1, max_seq_len=4096, vision_attention="bf16", vision_quant=Int8DynamicConfig(kernel)
        )
        engines[name].vision.use_attention_kernel(own)
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
    exact = outputs["fp32"].flatten()
    return {
        "int8_kernel": kernel,
        "seconds": {name: min(t) for name, t in times.items()},
        "ratio_to_fp32": {name: min(t) / min(times["fp32"]) for name, t in times.items() if name != "fp32"},
        "cosine_vs_fp32_attention": {
            name: F.cosine_similarity(exact, out.flatten(), dim=0).item()
            for name, out in outputs.items()
            if name != "fp32"
        },
        "reasons": {name: e.vision_attention_reason for name, e in engines.items() if name in ("fp32", "bf16")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--model", help="a full-size checkpoint (default: the synthetic one, made once)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = own_kernels()
    if not kernels:
        raise SystemExit(f"no own attention runs here: {attention_status().reason}")
    model = args.model or cached_synthetic_model("full", seed=0)
    result = {"threads": args.threads, "isa_class": isa_class(read_topology().isa).name}
    result["attention"] = attention_alone(kernels)
    result["layout_vision_pass"] = layout_pass(model, args.reps, kernels)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
