"""The fast preset with each INT8 kernel on the same replayed page, alternated in one process.

Both parsers are loaded, then the median workload page is parsed with each in turn for
``--rounds`` rounds (A B A B ...). Each parse records wall seconds and the process's CPU seconds
(user + system): on a machine shared with other work the CPU time is what the parse itself
cost, while its wall time mostly measures the others; with ``--threads 1`` the CPU seconds equal
the wall seconds of an idle core. The ratio is of the fastest rounds' CPU seconds. With
``--fidelity`` the same kernels are then compared with the float32 engine over every forced step
of that page (``mineru_fast.bench.fidelity``); ``--rounds 0`` runs only that.

``python benchmarks/int8_side_by_side.py --model DIR [--kernels onednn torch_ao] [--rounds 2]
[--fidelity] [--json OUT]``; set ``mineru_fast.runtime.cpu.simulation_env(...)`` in the environment to
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
from mineru_fast.protocol.traces import Trace
from mineru_fast.runtime.choice import choose_int8_kernel, choose_preset
from mineru_fast.runtime.cpu import isa_class, read_topology


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kernels", nargs="+", default=["onednn", "torch_ao"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--fidelity-threads", type=int, default=None, help="threads of the fidelity run (default: cores)")
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
    parsers = {}
    for kernel in args.kernels if args.rounds else []:
        options = ParserOptions.preset("fast", threads=args.threads, int8_kernel=kernel)
        parsers[kernel] = DocumentParser.from_pretrained(args.model, options)
    out["kernel_paths"] = {k: p.engine.numerics["int8_kernel_path"] for k, p in parsers.items()}
    wall: dict[str, list[float]] = {k: [] for k in parsers}
    cpu: dict[str, list[float]] = {k: [] for k in parsers}
    markdown = {}
    for round_ in range(args.rounds):
        for kernel, parser in parsers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            document = parser.parse([page.image], replay=Trace([page.trace]))
            wall[kernel].append(time.perf_counter() - start)
            cpu[kernel].append(time.process_time() - start_cpu)
            markdown[kernel] = document.to_markdown()
            print(f"[side-by-side] round {round_ + 1} {kernel}: wall {wall[kernel][-1]:.1f} s, "
                  f"cpu {cpu[kernel][-1]:.1f} s", flush=True)  # fmt: skip
    if args.rounds:
        best = {k: min(v) for k, v in cpu.items()}
        first = args.kernels[0]
        out.update(wall_s=wall, cpu_s=cpu, best_cpu_s=best, cpu_ratio_to_first={k: best[k] / best[first] for k in best},
                   same_markdown=len(set(markdown.values())) == 1)  # fmt: skip
    del parsers
    gc.collect()
    if args.fidelity:
        start = time.perf_counter()
        configs = {k: {"preset": "fast", "overrides": {"int8_kernel": k}} for k in args.kernels}
        out["fidelity"] = run_fidelity({"model": args.model, "threads": args.fidelity_threads, "configs": configs})
        out["fidelity_s"] = time.perf_counter() - start
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
