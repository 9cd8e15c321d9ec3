"""The INT8 kernels on MinerU2.5's real linear shapes, per ISA class, side by side in one process.

Kernels (see ``mineru_fast/engine/quantize.py`` for what each does): ``torch_ao`` (fbgemm,
per-tensor 7-bit activations: the default until issue 17), ``onednn`` and ``int_mm`` (per-token
int8 activations), the float32 linear, the bfloat16 linear where the class has native bfloat16,
and weight-only INT8 (``torch.ops.aten._weight_int8pack_mm``, float activations) at decode batch
sizes, where a layer is bound by reading its weights; for the language model's shapes, where the
own kernels are built (``engine.kernels``), also ``gemv`` (per channel / per token, the own GEMV
for up to 16 rows) and ``block`` (32-value scales, ``quantize.BlockInt8Linear``: the fast
preset's language model).

Shapes: the vision block's qkv (1280->3840), proj (1280->1280), fc1 (1280->5120) and fc2
(5120->1280) at 5476 rows (one 1036x1036 layout image) and at crop sizes (1024 and 256 patches);
the merger (5120->5120, 5120->896) at 1369 rows; the LM's qkv (896->1152), o (896->896),
gate_up (896->9728) and down (4864->896) at decode batch 1, 4 and 16 and at prefill (1400 and
256 rows), and the LM head (896->151936) at 1 and 16 rows.

Each figure is the fastest of ``--repeat`` calls after one warm-up (the fastest, not the median:
on a shared machine it is the least disturbed), the kernels interleaved call by call.

``python benchmarks/int8_kernels.py [--isa native|avx2|avx512|avx512_vnni] [--threads N] [--layers P] [--json OUT]``
``--isa`` other than ``native`` runs a simulated class in a subprocess with
``mineru_fast.runtime.cpu.simulation_env`` set before torch loads; ``--layers lm.`` measures only
the language model's shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VISION = [("vision.qkv", 1280, 3840), ("vision.proj", 1280, 1280), ("vision.fc1", 1280, 5120),
          ("vision.fc2", 5120, 1280)]  # fmt: skip
MERGER = [("merger.fc1", 5120, 5120), ("merger.fc2", 5120, 896)]
LM = [("lm.qkv", 896, 1152), ("lm.o", 896, 896), ("lm.gate_up", 896, 9728), ("lm.down", 4864, 896)]
SHAPES = (
    [(name, k, n, m) for m in (5476, 1024, 256) for name, k, n in VISION]
    + [(name, k, n, 1369) for name, k, n in MERGER]
    + [(name, k, n, m) for m in (1, 4, 16, 256, 1400) for name, k, n in LM]
    + [("lm.head", 896, 151936, m) for m in (1, 16)]
)
GROUPS = {  # sums reported per group: one vision block, one LM layer (head apart), the LM head
    "vision block @5476": ("vision.", 5476),
    "vision block @1024": ("vision.", 1024),
    "vision block @256": ("vision.", 256),
    "LM layer @1 (decode)": ("lm.", 1),
    "LM layer @16 (decode)": ("lm.", 16),
    "LM layer @1400 (prefill)": ("lm.", 1400),
    "LM head @1": ("lm.head", 1),
    "LM head @16": ("lm.head", 16),
}


def _kernels(name: str, k: int, n: int, m: int, native_bf16: bool) -> dict:
    import torch
    from torch import nn

    from mineru_fast.engine.kernels import kernel_status
    from mineru_fast.engine.quantize import BlockInt8Linear, GemvInt8Linear, Int8DynamicConfig, quantize_

    torch.manual_seed(0)
    linear = nn.Linear(k, n).eval()
    out = {"fp32": linear}
    if native_bf16:
        out["bf16"] = nn.Linear(k, n).to(torch.bfloat16).eval()
    for backend in ("torch_ao", "onednn", "int_mm"):
        copy = nn.Linear(k, n)
        copy.load_state_dict(linear.state_dict())
        out[backend] = quantize_(nn.Sequential(copy), Int8DynamicConfig(backend))
    if m <= 16:
        w = linear.weight.detach()
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).to(torch.int8)
        out["weight_only"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale).add_(linear.bias)
    if name.startswith("lm.") and kernel_status().block is not None:
        out["gemv"], out["block"] = GemvInt8Linear(linear), BlockInt8Linear(linear)
    return out


def measure(repeat: int, layers: str = "") -> dict:
    """Every shape's kernels (of layers named from ``layers``) in this process: ``{"shapes": [...],
    "groups": {...}}`` in ms."""
    import torch

    from mineru_fast.engine.quantize import int8_kernel_path
    from mineru_fast.runtime.cpu import isa_class, read_topology

    cls = isa_class(read_topology().isa)
    rows = []
    with torch.inference_mode():
        for name, k, n, m in [shape for shape in SHAPES if shape[0].startswith(layers)]:
            kernels = _kernels(name, k, n, m, cls.native_bf16)
            inputs = {
                key: torch.randn(m, k, dtype=torch.bfloat16 if key == "bf16" else torch.float32) for key in kernels
            }
            best = dict.fromkeys(kernels, float("inf"))
            for key, fn in kernels.items():
                fn(inputs[key])
            calls = repeat if m * k * n < 2e9 else max(3, repeat // 4)
            for _ in range(calls):
                for key, fn in kernels.items():
                    start = time.perf_counter()
                    fn(inputs[key])
                    best[key] = min(best[key], time.perf_counter() - start)
            rows.append({"layer": name, "rows": m, "in": k, "out": n, "ms": {key: 1e3 * s for key, s in best.items()}})
            print(f"[int8_kernels] {name} @{m}: " + " ".join(f"{key}={1e3 * s:.2f}" for key, s in best.items()),
                  file=sys.stderr, flush=True)  # fmt: skip
    groups = {}
    for label, (prefix, m) in GROUPS.items():
        members = [r for r in rows if r["layer"].startswith(prefix) and r["rows"] == m
                   and (r["layer"] != "lm.head" or prefix == "lm.head")]  # fmt: skip
        if not members:
            continue
        keys = set.intersection(*(set(r["ms"]) for r in members))
        groups[label] = {key: sum(r["ms"][key] for r in members) for key in sorted(keys)}
    return {
        "isa_class": cls.name,
        "hardware_class": cls.hardware,
        "capped_by": cls.capped_by,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernel_paths": {b: int8_kernel_path(b) for b in ("torch_ao", "onednn", "int_mm")},
        "shapes": rows,
        "groups": groups,
    }


def render(result: dict) -> str:
    """Markdown: the groups' totals and each kernel's ratio to ``torch_ao``."""
    keys = ["torch_ao", "onednn", "int_mm", "fp32", "bf16", "weight_only", "gemv", "block"]
    lines = [
        f"ISA class {result['isa_class']} (hardware {result['hardware_class']}"
        + (f", capped by {result['capped_by']}" if result["capped_by"] else "")
        + f"), torch {result['torch']}, {result['threads']} threads",
        *[f"- {path}" for path in result["kernel_paths"].values()],
        "",
        "| linears | " + " | ".join(f"{k} ms" for k in keys) + " | onednn / torch_ao | int_mm / torch_ao |",
        "|---" * (len(keys) + 3) + "|",
    ]
    for label, ms in result["groups"].items():
        cells = [f"{ms[k]:.2f}" if k in ms else "-" for k in keys]
        ratios = [f"{ms[k] / ms['torch_ao']:.2f}" for k in ("onednn", "int_mm")]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native", help="native, or a class to simulate: avx2, avx512, avx512_vnni")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    ap.add_argument("--repeat", type=int, default=12, help="timed calls per kernel and shape")
    ap.add_argument("--layers", default="", help="only shapes whose layer name starts with this (e.g. lm.)")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.isa != "native" and not args.child:
        from mineru_fast.runtime.cpu import simulation_env

        env = {**os.environ, **simulation_env(args.isa)}
        sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=env).returncode)
    import torch

    from mineru_fast.runtime.cpu import physical_cores_available

    torch.set_num_threads(args.threads or physical_cores_available())
    result = measure(args.repeat, args.layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(render(result))


if __name__ == "__main__":
    main()
