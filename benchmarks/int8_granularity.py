"""What finer INT8 scales would buy on the trained-LM fixture: simulated granularities, forced steps.

The fast preset's INT8 has one scale per output channel of a weight and one per token (row) of an
activation. llama.cpp's Q8_0 has one per block of 32 consecutive values along the reduction
dimension, for weights and activations alike. This script measures, on the real-text forced steps
of ``mineru_fast.bench.fidelity`` (``run_content``'s requests, top-1 agreement with the float32
engine over all steps and over the confident ones), the language model's linears under each
granularity, **simulated**: a linear's weight and its input are quantized to int8 with the given
scales and dequantized, and the product is taken in float32 (the integer sums of a real kernel are
exact; these differ from them by float32 rounding only). So the figures are numerics, not a kernel:
nothing here is faster. The vision tower is the fast preset's (per-token INT8), as in every fast
row of the fidelity table.

``PYTHONPATH=. python benchmarks/int8_granularity.py --model <trained-lm> --workload
<shared>/workloads/omnidocbench_demo [--threads 2] [--forced-steps 250]`` prints one JSON line per
granularity.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mineru_fast.bench import fidelity
from mineru_fast.bench.workload import load_workload
from mineru_fast.engine.factory import build_engine
from mineru_fast.engine.preprocess import Preprocessor
from mineru_fast.engine.quantize import Bf16WeightsLinear
from mineru_fast.options import ParserOptions

# (label, weight group, activation group, LM head quantized too, linears kept float); group None: a
# whole row (one scale per output channel of a weight, per token of an activation).
GRANULARITIES = [
    ("per-channel weights, per-token activations (the fast preset's scales)", None, None, True, ()),
    ("32-value blocks for weights, per-token activations", 32, None, True, ()),
    ("per-channel weights, 32-value blocks for activations", None, 32, True, ()),
    ("32-value blocks for both (Q8_0's granularity)", 32, 32, True, ()),
    ("128-value blocks for both", 128, 128, True, ()),
    ("32-value blocks for both, float LM head", 32, 32, False, ()),
    # the fast preset's scales with one kind of linear (every layer's) left in float
    ("fast preset's scales, w_down float", None, None, True, ("w_down",)),
    ("fast preset's scales, wqkv float", None, None, True, ("wqkv",)),
    ("fast preset's scales, wo float", None, None, True, ("wo",)),
    ("fast preset's scales, w_gate_up float", None, None, True, ("w_gate_up",)),
    ("fast preset's scales, w_down float, float LM head", None, None, False, ("w_down",)),
]


def fake_int8(t: torch.Tensor, group: int | None) -> torch.Tensor:
    """``t`` ``[..., K]`` float32 rounded to symmetric int8 (``-127..127``) and back, one scale
    (``max|x| / 127``) per ``group`` consecutive values of the last dimension (None: per row)."""
    blocks = t.reshape(*t.shape[:-1], -1, group) if group else t.unsqueeze(-2)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(blocks / scale).clamp(-127, 127) * scale).reshape(t.shape)


class FakeInt8Linear(nn.Module):
    """``y = q(x) q(W)^T + b`` with ``q`` = ``fake_int8`` at the given groups; float32 math."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_group, input_group) -> None:
        super().__init__()
        self.weight, self.bias, self.input_group = fake_int8(weight.float(), weight_group), bias, input_group
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_int8(x.float(), self.input_group), self.weight, self.bias).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the trained-LM checkpoint (trained_lm.py)")
    parser.add_argument("--workload", type=Path, required=True, help="an OmniDocBench-format workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forced-steps", type=int, default=250, help="forced steps per block type")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pages = load_workload(None, args.workload)
    counter = Preprocessor(args.model)
    forced, _ = fidelity.content_requests(
        pages, ParserOptions(), lambda t: len(counter.forced_ids(t)), args.forced_steps, 0
    )
    reference = build_engine(args.model, fidelity._options(fidelity.FP32, args.threads), prepared_cache=False)
    steps = [fidelity.ReferenceSteps.of(fidelity.forced_logits_prefill(reference, r)) for _, r in forced]
    reference.close()
    del reference
    # The fast preset with its language model's linears kept as stored (bfloat16), to be swapped.
    float_lm = {"preset": "fast", "overrides": {"lm_quant": "bf16-weights", "lm_head_quant": "bf16-weights"}}
    engine = build_engine(args.model, fidelity._options(float_lm, args.threads), prepared_cache=False)
    slots = [
        (parent, name, module)
        for layer in engine.lm.layers
        for parent in (layer.attention, layer.feed_forward)
        for name, module in list(parent.named_children())
        if isinstance(module, Bf16WeightsLinear)
    ]
    head = engine.lm.lm_head
    for label, weight_group, input_group, head_too, kept_float in GRANULARITIES:
        for parent, name, module in slots:
            bias = None if module.bias is None else module.bias.float()
            fake = FakeInt8Linear(module.weight_bf16, bias, weight_group, input_group)
            setattr(parent, name, module if name in kept_float else fake)
        engine.lm.lm_head = FakeInt8Linear(head.weight_bf16, None, weight_group, input_group) if head_too else head
        start = time.perf_counter()
        same = confident_same = confident = total = 0
        for (_, request), ref in zip(forced, steps, strict=True):
            agree = fidelity.forced_logits_prefill(engine, request).argmax(-1) == ref.top1
            same, total = same + int(agree.sum()), total + len(agree)
            confident_same += int((agree & ref.confident).sum())
            confident += int(ref.confident.sum())
        print(json.dumps({
            "granularity": label, "steps": total, "top1_pct": round(100 * same / total, 2),
            "confident_steps": confident, "confident_top1_pct": round(100 * confident_same / max(1, confident), 2),
            "seconds": round(time.perf_counter() - start, 1),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
