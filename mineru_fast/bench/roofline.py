"""This CPU's ceilings and how close the engine gets to them.

Peaks are measured here, never assumed: the best GEMM throughput for float32, bfloat16 and int8
(``torch._int_mm`` or the engine's dynamic INT8 linear) on the engine's own vision MLP shapes for
one 1036x1036 page (MinerU2.5's for the full-size model, the small ones of a test model, so a unit
test measures in seconds), and memory bandwidth from a copy much larger than the caches.
Achieved figures come from timing the fast engine's own modules on the same page: the vision
linears of one block, the vision attention of one block (the own bfloat16 kernel where the engine
runs it, else PyTorch's SDPA), and one batch-1 decode step (bytes of weights read per step over its
time).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

N_LAYOUT, VISION_DIM, VISION_MLP = 5476, 1280, 5120  # one 1036x1036 page through MinerU2.5 vision


def best_seconds(fn: Callable[[], object], repeat: int = 3) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_peaks(dim: int = VISION_DIM, mlp: int = VISION_MLP, tokens: int = N_LAYOUT) -> dict[str, float]:
    """Best GFLOP/s (GOP/s for int8) per dtype over the two vision-MLP products, ``tokens x dim @
    dim x mlp`` and ``tokens x mlp @ mlp x dim`` (the deeper reduction often runs faster); for int8
    the faster of ``torch._int_mm`` and the engine's own dynamic INT8 linear (fbgemm where
    available, activation quantization included), which can beat it. The defaults are
    MinerU2.5's: 5476x1280 @ 1280x5120 and 5476x5120 @ 5120x1280."""
    from mineru_fast.engine.quantize import Int8DynamicConfig, quantize_

    out = {"fp32": 0.0, "bf16": 0.0, "int8": 0.0}
    for m, k, n in ((tokens, dim, mlp), (tokens, mlp, dim)):
        giga = 2 * m * k * n / 1e9
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            out[name] = max(out[name], giga / best_seconds(functools.partial(torch.matmul, a, b)))
        a8 = torch.randint(-127, 127, (m, k), dtype=torch.int8)
        b8 = torch.randint(-127, 127, (k, n), dtype=torch.int8)
        linear = quantize_(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)), Int8DynamicConfig())
        x = torch.randn(m, k)
        with torch.inference_mode():
            int_mm = best_seconds(functools.partial(torch._int_mm, a8, b8))
            seconds = min(int_mm, best_seconds(functools.partial(linear, x)))
        out["int8"] = max(out["int8"], giga / seconds)
    return out


def memory_bandwidth(mebibytes: int = 512) -> float:
    """GB/s of a float32 copy of ``mebibytes`` MiB (bytes read + written)."""
    src = torch.ones(mebibytes * 1024 * 1024 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / seconds / 1e9


def lm_weight_count(config) -> int:
    """Weights a decode step reads: every LM linear plus the LM head (embedding rows are gathered)."""
    c = config
    attention = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    return c.num_layers * (attention + 3 * c.hidden_size * c.intermediate_size) + c.vocab_size * c.hidden_size


def achieved(engine, bytes_per_weight: float) -> dict[str, float]:
    """Throughput of the fast engine's vision linears, vision attention (one block, layout-page
    shape) and batch-1 decode (weight bytes read per second, ``bytes_per_weight`` each)."""
    block = engine.vision.blocks[0]
    config = engine.vision.config
    dim, heads, mlp = config.embed_dim, config.num_heads, config.embed_dim * config.mlp_ratio
    dtype = block.norm1.weight.dtype
    x = torch.randn(N_LAYOUT, dim, dtype=dtype)
    q = torch.randn(1, heads, N_LAYOUT, config.head_dim, dtype=dtype)
    linear_flops = 2 * N_LAYOUT * (4 * dim * dim + 2 * dim * mlp)
    attention_flops = 4 * N_LAYOUT * N_LAYOUT * config.head_dim * heads

    def linears() -> None:
        block.qkv(x)
        block.proj(x)
        block.fc2(block.fc1(x))

    def attention() -> None:  # what the engine's blocks run: the own kernel where set (float32 only), else SDPA
        if block.attention_kernel is not None:
            block.attention_kernel(q[0], q[0], q[0], out)
        else:
            F.scaled_dot_product_attention(q, q, q)

    out = torch.empty(N_LAYOUT, heads * config.head_dim)
    with torch.inference_mode():
        linear_s = best_seconds(linears, repeat=2)
        attention_s = best_seconds(attention, repeat=2)
        tokens, position = torch.zeros(1, dtype=torch.long), torch.full((1,), 1500)
        decode_s = best_seconds(lambda: engine.lm.decode(tokens, position, position), repeat=5)
    weight_bytes = lm_weight_count(engine.lm.config) * bytes_per_weight
    return {
        "vision_linears_gops": linear_flops / linear_s / 1e9,
        "vision_attention_gflops": attention_flops / attention_s / 1e9,
        "decode_batch1_gbps": weight_bytes / decode_s / 1e9,
        "decode_batch1_ms": decode_s * 1000,
    }
