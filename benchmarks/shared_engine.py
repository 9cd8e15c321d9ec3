"""One shared engine per process, measured side by side in one run.

    python benchmarks/shared_engine.py --model DIR [--threads N] [--pages 4] [--chat 16] [-o FILE]

With one loaded fast-preset parser (replayed workload pages, so every run decodes the same tokens):

1. ``parse``: the same pages parsed one call at a time, as one multi-page call, and as concurrent
   one-page calls from as many threads; pages/min, P95 latency, and the longest any decode step
   waited for admission work (vision blocks, prefill chunks) while others decoded, with the engine
   loop thread's CPU seconds during that wait. Each mode also records the process's CPU seconds
   (the same pages cost the same CPU in every mode) and its threads' run-queue wait (Linux
   ``/proc/self/task/*/schedstat``: seconds runnable but not running because other processes
   held the cores). A mode with a run-queue wait of more than a few percent of its wall time, or
   a longest wait far above its CPU time, ran on a busy machine: its wall figures do not compare.
2. ``chat``: crop requests of the workload pages (in page order, the first ``--chat`` of them)
   through ``POST /v1/chat/completions`` of a real server on loopback (the same parser behind
   it), sent one at a time and all at once; requests/s and P95. Each request asks for exactly
   its block's token count (``min_tokens = max_tokens``), so both runs decode the same tokens.
3. ``decode``: decode steps per second and tokens per second at batch 1, 4 and 16.

Prints a Markdown summary and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import threading
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_queue_waits() -> dict[int, float]:
    """Seconds each thread of this process has waited on a run queue (runnable, not running):
    field 2 of ``/proc/self/task/<tid>/schedstat``, in ns; empty where the file is absent."""
    waits = {}
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            waits[int(stat.parent.name)] = int(stat.read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return waits


def run_queue_wait_since(before: dict[int, float]) -> float | None:
    """Run-queue seconds of the threads alive now since ``before`` (threads that ended in
    between are not counted); None without ``schedstat``."""
    now = run_queue_waits()
    return sum(v - before.get(tid, 0.0) for tid, v in now.items()) if now else None


def timed_parse(parser, pages, label: str) -> dict:
    """Parse ``pages`` (WorkloadPage) in the way ``label`` names; reset and read the stall gauge,
    the process's CPU seconds and its threads' run-queue wait."""
    from mineru_fast.protocol.traces import Trace

    scheduler = parser.engine.scheduler
    scheduler.max_decode_wait_s = scheduler.max_decode_wait_cpu_s = 0.0
    queued, cpu = run_queue_waits(), time.process_time()
    latencies: list[float] = []

    def one(batch) -> None:
        start = time.perf_counter()
        doc = parser.parse([p.image for p in batch], replay=Trace([p.trace for p in batch]))
        assert doc.status == "success", [p.errors + p.warnings for p in doc.pages]
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    if label == "one call at a time":
        for page in pages:
            one([page])
    elif label == "one multi-page call":
        one(pages)
    else:
        threads = [threading.Thread(target=one, args=([page],)) for page in pages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - start
    return {
        "mode": label,
        "wall_s": wall,
        "pages_per_min": 60 * len(pages) / wall,
        "p95_latency_s": percentile(latencies, 0.95),
        "max_decode_wait_s": scheduler.max_decode_wait_s,
        "max_decode_wait_cpu_s": scheduler.max_decode_wait_cpu_s,
        "cpu_s": time.process_time() - cpu,
        "run_queue_wait_s": run_queue_wait_since(queued),
    }


def crop_requests(pages, limit: int) -> list[dict]:
    """Chat bodies for the blocks MinerU reads (PNG crop, task prompt), taken from ``pages`` in
    order until ``limit``, with the block's replayed text under ``_text`` (its token count becomes
    the request's exact length)."""
    from mineru_fast.protocol.page import plan_content, read_layout
    from mineru_fast.protocol.spec import SYSTEM_PROMPT

    bodies = []
    for page in pages:
        layout = read_layout(page.trace.layout)
        for request in plan_content(page.image, layout, image_analysis=False):
            content = page.trace.content_for(layout.blocks[request.block_index])
            if content is None:
                continue
            buf = io.BytesIO()
            request.image.save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            user = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": request.prompt}]
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
            body = {"model": "m", "messages": messages, "temperature": 0.0, "top_k": 1, "skip_special_tokens": False}
            bodies.append({"_text": content, **body})
            if len(bodies) == limit:
                return bodies
    return bodies


def chat_runs(parser, model: str, pages, count: int) -> list[dict]:
    """The chat endpoint of a real server on loopback, sequential and concurrent."""
    import httpx
    import uvicorn

    from mineru_fast.serve import ServeConfig, create_app

    preprocessor = parser.engine.preprocessor
    bodies = crop_requests(pages, count)
    for body in bodies:
        n = len(preprocessor.text_ids(body.pop("_text"))) + 1
        body["max_tokens"] = body["min_tokens"] = n
    config = ServeConfig(model=model, port=0)
    app = create_app(config, parser_factory=lambda: parser)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.1)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=3600) as client:
        while client.get(f"{url}/ready").status_code != 200:
            time.sleep(0.5)
        name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        for body in bodies:
            body["model"] = name
        out = []
        for mode in ("one at a time", "all at once"):
            latencies: list[float] = []
            tokens: list[int] = []

            def send(body: dict, latencies: list[float] = latencies, tokens: list[int] = tokens) -> None:
                start = time.perf_counter()
                response = client.post(f"{url}/v1/chat/completions", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)
                tokens.append(response.json()["usage"]["completion_tokens"])

            start = time.perf_counter()
            if mode == "one at a time":
                for body in bodies:
                    send(body)
            else:
                threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            wall = time.perf_counter() - start
            out.append({"mode": mode, "requests": len(bodies), "wall_s": wall, "requests_per_s": len(bodies) / wall,
                        "p95_latency_s": percentile(latencies, 0.95), "completion_tokens": sum(tokens)})  # fmt: skip
    server.should_exit = True
    thread.join(60)
    return out


def decode_rates(engine, sizes: tuple[int, ...] = (1, 4, 16), steps: int = 16) -> list[dict]:
    """Decode steps/s and tokens/s at each batch size (512 cached positions per slot)."""
    import torch

    lm = engine.lm
    out = []
    with torch.inference_mode():
        for batch in sizes:
            embeds = lm.embed_tokens(torch.full((512,), 100))
            positions = torch.arange(512).expand(3, -1)
            for slot in range(batch):
                lm.prefill_chunks([(embeds, positions, slot, 0)])
            tokens = torch.full((batch,), 100)
            lm.decode(tokens, torch.full((batch,), 512), torch.full((batch,), 512))  # warm
            start = time.perf_counter()
            for step in range(steps):
                lm.decode(tokens, torch.full((batch,), 513 + step), torch.full((batch,), 513 + step))
            seconds = (time.perf_counter() - start) / steps
            out.append({"batch": batch, "ms_per_step": 1000 * seconds, "tokens_per_s": batch / seconds})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--chat", type=int, default=16, help="crop requests through the chat endpoint")
    ap.add_argument("--only", choices=("parse", "chat", "decode"), action="append")
    ap.add_argument("-o", "--output", type=Path, default=Path("shared_engine.json"))
    args = ap.parse_args()

    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.bench.rows import warm_up
    from mineru_fast.bench.workload import load_workload

    only = set(args.only or ("parse", "chat", "decode"))
    parser = DocumentParser.from_pretrained(args.model, ParserOptions.preset("fast", threads=args.threads))
    warm_up(parser)
    pages = load_workload(args.pages)
    results: dict = {"model": args.model, "threads": args.threads, "pages": [p.name for p in pages]}
    if "parse" in only:
        results["parse"] = []
        for mode in ("one call at a time", "one multi-page call", "concurrent one-page calls"):
            print(f"[shared-engine] parse: {mode} ...", file=sys.stderr, flush=True)
            results["parse"].append(timed_parse(parser, pages, mode))
            args.output.write_text(json.dumps(results, indent=1))  # kept if a later section fails
    if "chat" in only:
        print("[shared-engine] chat ...", file=sys.stderr, flush=True)
        results["chat"] = chat_runs(parser, args.model, pages, args.chat)
        args.output.write_text(json.dumps(results, indent=1))
    if "decode" in only:
        print("[shared-engine] decode ...", file=sys.stderr, flush=True)
        # This thread drives the model directly: the engine loop stops first, so its OpenMP pool is
        # gone and this thread's pool is the only one (see mineru_fast.runtime.threads).
        parser.close()
        results["decode"] = decode_rates(parser.engine)
    args.output.write_text(json.dumps(results, indent=1))
    for section in ("parse", "chat", "decode"):
        for row in results.get(section, []):
            print(section, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if "parse" in results:
        seq, multi, conc = (r["pages_per_min"] for r in results["parse"])
        print(f"concurrent / sequential {conc / seq:.2f}x; concurrent / one call {conc / multi:.2f}x")
    if "chat" in results:
        one, many = (r["requests_per_s"] for r in results["chat"])
        print(f"chat all at once / one at a time {many / one:.2f}x")
    parser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
