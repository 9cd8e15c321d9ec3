"""Bounded load run against ``mineru-fast serve`` on the loopback interface: throughput and P95.

Starts the server on 127.0.0.1 (a tiny synthetic model unless ``--model`` is given), sends
``--requests`` synchronous parses (``POST /v1/document/parse``) with ``--concurrency`` in flight,
stops after all of them or after ``--max-seconds``, prints throughput and latency percentiles, and
stops the server. ``--url`` targets a server already running, on a loopback address only. For a
server it started, it also prints the server's peak RSS (``VmHWM``): with ``--workers 4`` against
``--workers 1`` it shows that job workers share one model.

    python benchmarks/serve_load.py [--model DIR] [--requests 40] [--concurrency 4] [--pages 1] [--threads 1]
                                    [--workers 4] [--preset exact] [--max-seconds 120]
                                    [--url http://127.0.0.1:8000 --api-key KEY]
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import math
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

BOUNDS = "layout=24,text=8,table=8,equation=8"


def loopback_only(url: str) -> None:
    """Refuse any URL whose host does not resolve to a loopback address."""
    host = urlparse(url).hostname or ""
    address = ipaddress.ip_address(socket.gethostbyname(host))
    if not address.is_loopback:
        sys.exit(f"serve_load: {url} is not a loopback address; this load run only targets 127.0.0.0/8")


def document(pages: int) -> bytes:
    """An image-only PDF of ``pages`` drawn pages."""
    from PIL import Image, ImageDraw, ImageFont

    images = []
    for n in range(pages):
        page = Image.new("RGB", (850, 1100), "white")
        draw = ImageDraw.Draw(page)
        draw.text((60, 50), f"Load page {n + 1}", fill="black", font=ImageFont.load_default(size=40))
        for i in range(14):
            draw.text(
                (60, 130 + 34 * i),
                f"Line {i} of the load-run page.",
                fill="black",
                font=ImageFont.load_default(size=24),
            )
        images.append(page)
    buffer = io.BytesIO()
    images[0].save(buffer, format="PDF", save_all=True, append_images=images[1:], resolution=100.0)
    return buffer.getvalue()


def start_server(
    model: Path, queue: int, threads: int, workers: int, preset: str, log: Path
) -> tuple[subprocess.Popen, str]:
    """Start ``mineru-fast serve`` on a free loopback port and wait (bounded) until it is ready."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "mineru_fast.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--model", str(model), "--preset", preset, "--max-new-tokens", BOUNDS, "--workers-queue", str(queue)]
    # --canary before-ready: the canary page (about a minute at full size) is parsed before the
    # load starts, as a warm-up, never beside the measured requests
    command += ["--threads", str(threads), "--workers", str(workers), "--canary", "before-ready"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"serve_load: the server exited with {process.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    sys.exit(f"serve_load: the server was not ready within 300 s; see {log}")


def peak_rss_gib(pid: int) -> float | None:
    """``VmHWM`` of a live process in GiB (Linux), or None where /proc does not have it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run(url: str, api_key: str | None, payload: bytes, requests: int, concurrency: int, max_seconds: float) -> dict:
    """Send the requests; returns counts, latencies of the successful ones and the wall time."""
    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}
    lock = threading.Lock()
    next_index = 0
    latencies: list[float] = []
    counts = {"ok": 0, "rejected": 0, "errors": 0}
    deadline = time.monotonic() + max_seconds

    def worker() -> None:
        nonlocal next_index
        with httpx.Client(base_url=url, headers=headers, timeout=max(10.0, max_seconds)) as client:
            while time.monotonic() < deadline:
                with lock:
                    if next_index >= requests:
                        return
                    next_index += 1
                start = time.perf_counter()
                try:
                    response = client.post("/v1/document/parse", files={"file": ("load.pdf", payload)})
                    status = response.status_code
                except httpx.HTTPError:
                    status = 0
                elapsed = time.perf_counter() - start
                with lock:
                    if status == 200:
                        counts["ok"] += 1
                        latencies.append(elapsed)
                    elif status == 429:
                        counts["rejected"] += 1
                    else:
                        counts["errors"] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    return {**counts, "latencies": latencies, "wall": time.perf_counter() - start, "sent": next_index}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny synthetic model, made here)")
    ap.add_argument("--url", help="a running server on a loopback address (default: start one)")
    ap.add_argument("--api-key", help="API key for --url")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pages", type=int, default=1, help="pages per document (default: 1)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="stop sending after this long")
    ap.add_argument(
        "--threads", type=int, default=1, help="server intra-op threads (default 1: the load client needs a core)"
    )
    ap.add_argument("--workers", type=int, default=4, help="server job workers (default 4, serve's default)")
    ap.add_argument("--preset", default="exact", help="server preset (default exact)")
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.pages < 1 or args.max_seconds <= 0:
        sys.exit("serve_load: --requests, --concurrency, --pages and --max-seconds must be positive")

    with tempfile.TemporaryDirectory() as tmp:
        process = None
        url = args.url
        if url:
            loopback_only(url)
        else:
            model = args.model
            if model is None:
                from mineru_fast.engine.synthetic import make_synthetic_model

                model = make_synthetic_model(Path(tmp) / "tiny", size="tiny", seed=0)
            queue = max(8, 2 * args.concurrency)
            process, url = start_server(model, queue, args.threads, args.workers, args.preset, Path(tmp) / "server.log")
        peak = None
        try:
            stats = run(url, args.api_key, document(args.pages), args.requests, args.concurrency, args.max_seconds)
        finally:
            if process is not None:
                peak = peak_rss_gib(process.pid)
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    ok, latencies = stats["ok"], stats["latencies"]
    print(f"target {url}: {stats['sent']} requests sent, concurrency {args.concurrency}, {args.pages} page(s) each")
    print(f"ok {ok}, rejected (429) {stats['rejected']}, errors {stats['errors']}, wall {stats['wall']:.2f} s")
    if peak is not None:
        print(f"server peak RSS {peak:.2f} GiB ({args.workers} job workers)")
    if not latencies:
        sys.exit("serve_load: no request succeeded")
    print(f"throughput {ok / stats['wall']:.2f} req/s, {ok * args.pages / stats['wall']:.2f} pages/s")
    print(
        f"latency p50 {percentile(latencies, 50):.3f} s, p95 {percentile(latencies, 95):.3f} s, "
        f"max {max(latencies):.3f} s"
    )


if __name__ == "__main__":
    main()
