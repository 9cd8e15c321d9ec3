"""The Python around a batch-1 decode step's kernels, before and after 2026-12-05, swapped in one
process and alternated step by step: the fast preset's language model on the full-size model, one
row at ``--context`` positions.

Before (the code of 877aad3, copied here): each block INT8 linear called ``kernel_status().block``
with its tensors, which took their pointers and sizes and reshaped ``x`` in and ``y`` out at every
call (its buffers read through ``nn.Module.__getattr__`` each time); ``RMSNorm`` called
``F.rms_norm`` through its Python wrapper;
``FeedForward`` asked both linears for ``rows_independent`` before seeing a decode row. After: the
layer's kernel bound once to its tensors (``kernels.bind_block_linear``; per call only ``x`` is
checked), ``torch.rms_norm`` called directly, the row count looked at first. The arithmetic is the
same: the logits are checked bit-identical before timing.

    python benchmarks/decode_call_overhead.py --model DIR [--threads 2] [--context 41 1500]
        [--steps 200] [--json OUT]

Prints one JSON object: per context, each side's ms per step (median, 10th percentile, fastest)
and the ratio of the medians (after over before). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mineru_fast.bench.report import print_json
from mineru_fast.engine import kernels
from mineru_fast.engine import model as lm_model
from mineru_fast.engine.factory import build_engine
from mineru_fast.engine.quantize import BlockInt8Linear
from mineru_fast.options import ParserOptions

AFTER = {
    (BlockInt8Linear, "forward"): BlockInt8Linear.forward,
    (lm_model.RMSNorm, "forward"): lm_model.RMSNorm.forward,
    (lm_model.FeedForward, "forward"): lm_model.FeedForward.forward,
}


BLOCK = kernels.kernel_status().block  # what each layer held as its kernel before


def linear_before(self: BlockInt8Linear, x: torch.Tensor) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    assert dtype == torch.float32 and BLOCK is not None and x.is_contiguous()  # the fast preset's decode rows
    y = BLOCK(x.view(-1, shape[-1]), self.weight_packed, self.weight_scale, self.bias, self.out_features)
    return y.view(*shape[:-1], self.out_features)


def norm_before(self: lm_model.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == torch.float32 and self.weight.dtype == torch.float32  # the fast preset's
    return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def feed_forward_before(self: lm_model.FeedForward, x: torch.Tensor) -> torch.Tensor:
    chunked = all(getattr(layer, "rows_independent", False) for layer in (self.w_gate_up, self.w_down))
    assert not chunked or x.numel() <= lm_model.MLP_CHUNK_ROWS * x.shape[-1]  # decode rows only here
    return self._rows(x)


BEFORE = {
    (BlockInt8Linear, "forward"): linear_before,
    (lm_model.RMSNorm, "forward"): norm_before,
    (lm_model.FeedForward, "forward"): feed_forward_before,
}


def summary(seconds: list[float]) -> dict[str, float]:
    """Milliseconds per step: median, 10th percentile, fastest."""
    ordered = sorted(seconds)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p10_ms": ordered[len(ordered) // 10] * 1e3,
        "fastest_ms": ordered[0] * 1e3,
    }


def use(side: dict) -> None:
    for (cls, name), function in side.items():
        setattr(cls, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, nargs="+", default=[41, 1500])
    parser.add_argument("--steps", type=int, default=200, help="steps per side and context")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if BLOCK is None:
        raise SystemExit(f"the own kernels do not run here: {kernels.kernel_status().reason}")
    engine = build_engine(args.model, ParserOptions.preset("fast", threads=args.threads))
    lm, token = engine.lm, torch.zeros(1, dtype=torch.long)
    sides = {"before": BEFORE, "after": AFTER}
    result: dict = {"threads": args.threads, "contexts": {}}
    try:
        with torch.inference_mode():
            for context in args.context:
                position = torch.tensor([context])
                logits = {}
                for name, side in sides.items():
                    use(side)
                    logits[name] = lm.decode(token, position, position)
                if not torch.equal(logits["before"], logits["after"]):
                    raise SystemExit("the two sides' logits differ: not the same arithmetic")
                seconds: dict[str, list[float]] = {name: [] for name in sides}
                for step in range(args.steps):
                    for name in ("before", "after") if step % 2 == 0 else ("after", "before"):
                        use(sides[name])
                        start = time.perf_counter()
                        lm.decode(token, position, position)
                        seconds[name].append(time.perf_counter() - start)
                figures: dict = {name: summary(values) for name, values in seconds.items()}
                figures["median_ratio"] = statistics.median(seconds["after"]) / statistics.median(seconds["before"])
                result["contexts"][str(context)] = figures
    finally:
        use(AFTER)
        engine.close()
    print_json(result, args.json)


if __name__ == "__main__":
    main()
