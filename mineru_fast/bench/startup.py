"""Start-up of the fast preset, each case in a fresh process: without the prepared-model cache (the
whole preparation, as before the cache existed), with an empty cache (prepared and written: the first
start), and again (read from the cache: every later start).

    python -m mineru_fast.bench.startup '{"model": DIR, "threads": 2}'   # one process, one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mineru_fast.engine.memory import peak_rss_bytes

CASES = (
    ("no prepared cache", "off"),
    ("cold (prepares and writes the cache)", "root"),
    ("warm (reads the cache)", "root"),
)


def run_startup(model: str, threads: int, root: Path) -> list[dict]:
    """The three cases in order, each a fresh process, the cold and warm ones with their prepared
    cache in ``root`` (an empty folder; the warm entry is left there); ``{"case", "load_s",
    "warmup_s", "prepared_from", "peak_rss_gb"}`` each, or ``{"case", "error"}``."""
    from mineru_fast.runtime.hub import PREPARED_CACHE_ENV as CACHE_ENV

    rows = []
    for case, cache in CASES:
        env = {**os.environ, CACHE_ENV: str(root) if cache == "root" else cache}
        spec = json.dumps({"model": model, "threads": threads})
        proc = subprocess.run([sys.executable, "-m", __name__, spec], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            rows.append({"case": case, "error": tail[0]})
            continue
        rows.append({"case": case, **json.loads(proc.stdout.strip().splitlines()[-1])})
    return rows


def _one(spec: dict) -> dict:
    from mineru_fast.bench.rows import warm_up
    from mineru_fast.options import ParserOptions
    from mineru_fast.pipeline.parser import DocumentParser

    start = time.perf_counter()
    parser = DocumentParser.from_pretrained(spec["model"], ParserOptions.preset("fast", threads=spec["threads"]))
    load_s = time.perf_counter() - start
    warmup_s = warm_up(parser)
    prepared_from = getattr(parser.engine, "prepared_from", None)
    parser.close()
    return {
        "load_s": load_s,
        "warmup_s": warmup_s,
        "prepared_from": prepared_from,
        "peak_rss_gb": peak_rss_bytes() / 1e9,
    }


if __name__ == "__main__":
    print(json.dumps(_one(json.loads(sys.argv[1]))))
