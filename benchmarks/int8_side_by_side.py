"""The fast preset with each INT8 kernel on the same replayed page, alternated in one process.

Both parsers are loaded, then the median workload page is parsed with each in turn for
``--rounds`` rounds (A B A B ...), so a busy machine slows both alike; the fastest round of each is
reported with the ratio. With ``--fidelity`` the same kernels are then compared with the float32
engine over every forced step of that page (``mineru_fast.bench.fidelity``).

``python benchmarks/int8_side_by_side.py --model DIR [--kernels onednn torch_ao] [--rounds 2]
[--fidelity] [--json OUT]``; set ``mineru_fast.cpu.simulation_env(...)`` in the environment to
measure as a lower ISA class.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.bench.fidelity import run as run_fidelity
from mineru_fast.bench.workload import load_workload
from mineru_fast.choice import choose_int8_kernel, choose_preset
from mineru_fast.cpu import isa_class, read_topology
from mineru_fast.traces import Trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kernels", nargs="+", default=["onednn", "torch_ao"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    topology = read_topology()
    cls = isa_class(topology.isa)
    page = load_workload(1)[0]
    out: dict = {
        "isa_class": cls.name,
        "hardware_isa_class": cls.hardware,
        "capped_by": cls.capped_by,
        "page": page.name,
        "auto_preset": {"candidate": choose_preset(topology).value, "reason": choose_preset(topology).reason},
        "int8_kernel_auto": choose_int8_kernel("auto", topology).value,
    }
    parsers = {k: DocumentParser.from_pretrained(args.model, ParserOptions.preset("fast", threads=args.threads,
                                                                                  int8_kernel=k))
               for k in args.kernels}  # fmt: skip
    out["kernel_paths"] = {k: p.engine.numerics["int8_kernel_path"] for k, p in parsers.items()}
    seconds: dict[str, list[float]] = {k: [] for k in parsers}
    markdown = {}
    for round_ in range(args.rounds):
        for kernel, parser in parsers.items():
            start = time.perf_counter()
            document = parser.parse([page.image], replay=Trace([page.trace]))
            seconds[kernel].append(time.perf_counter() - start)
            markdown[kernel] = document.to_markdown()
            print(f"[side-by-side] round {round_ + 1} {kernel}: {seconds[kernel][-1]:.1f} s", flush=True)
    best = {k: min(v) for k, v in seconds.items()}
    first = args.kernels[0]
    out.update(seconds=seconds, best_s=best, ratio_to_first={k: best[k] / best[first] for k in best},
               same_markdown=len(set(markdown.values())) == 1)  # fmt: skip
    del parsers
    gc.collect()
    if args.fidelity:
        start = time.perf_counter()
        configs = {k: {"preset": "fast", "overrides": {"int8_kernel": k}} for k in args.kernels}
        out["fidelity"] = run_fidelity({"model": args.model, "threads": args.threads, "configs": configs})
        out["fidelity_s"] = time.perf_counter() - start
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
