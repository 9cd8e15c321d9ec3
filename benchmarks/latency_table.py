"""The stage / concurrency / roofline tables (same code as ``mineru-fast bench``).

python benchmarks/latency_table.py [--quick] [--model DIR] [--pages N] [--workload DIR] [--threads N] [-o DIR]
"""

from __future__ import annotations

import sys

from mineru_fast.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
