"""A soak of ``mineru-fast serve``: a steady mix of every door for a long time, on loopback only.

Starts ``serve`` on 127.0.0.1 (a tiny synthetic model unless ``--model`` is given; two API keys),
then for ``--minutes`` keeps ``--clients`` clients busy, each drawing its next request from a mix:

- parse jobs of the document corpus (``../shared/corpus``, the hostile files too: a PDF that needs
  a password, a 39-megapixel PNG, a blank page), through ``/v1/document/parse``, pages 1-2;
- chat completions of a page image, answered whole or streamed (server-sent events);
- MinerU's v1 flow: ``POST /v1/uploads``, ``PUT`` the bytes, complete, a parse job, poll it;
- a raw ``/v1/tasks`` body;
- disconnects: a chat whose client gives up after 0.2 s, an upload ``PUT`` cut off mid-body;
- key errors: a wrong key (``401``).

Every answer is checked: a request that should succeed must (a corpus file must get the answer it
got the first time: the same HTTP status and error code), and no answer is a ``5xx``. Every 10 s
it samples the server's resident size and times ``GET /health``. At the end it waits for the
server to settle (bounded), reads its gauges (jobs, queue, chat generations, request bodies and
the upload store's bytes and records once ``--result-ttl`` has passed: all must be back to 0), stops it
with SIGTERM and times the drain. It prints one JSON report and exits 1 when a check failed:

    python benchmarks/soak.py [--minutes 30] [--clients 4] [--model DIR] [--shared ../shared]
                              [--rss-growth-mb 150] [--health-p99-ms 1000] [--report soak.json]

The RSS bound is on the drift after warm-up: the median of the last fifth of the run's samples
against the median of the second fifth (a leak moves it; a hostile file's decode, the 39-megapixel
PNG's ~0.5 GB inside the decode budget, is a peak of one sample, reported as the largest).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

BOUNDS = "layout=24,text=8,table=8,equation=8"
KEYS = {"alpha": "alpha-soak-0123456", "beta": "beta-soak-0123456"}
CORPUS_FILES = (
    "academic_fig_eq_table_1p.pdf", "blank_page.pdf", "cmyk.jpg", "doclaynet_page_2frames.tif", "gray16_trns.png",
    "huge_image_10973x3570.png", "password_required_pw-1234.pdf", "rotated_scan_rotate270.pdf",
    "slides_table_3p_rotate270.pdf", "encrypted_aes128_empty_userpw.pdf",
)  # fmt: skip
MIX = {
    "parse": 3,
    "chat": 3,
    "chat_stream": 2,
    "upload_job": 2,
    "task_raw": 1,
    "chat_abandon": 1,
    "put_cut": 1,
    "bad_key": 1,
}


def page_png() -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (400, 300), "white")
    ImageDraw.Draw(image).text((20, 20), "Soak page: some words to read.", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def one_page_pdf() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (850, 1100), "white").save(buffer, format="PDF", resolution=100.0)
    return buffer.getvalue()


class Soak:
    """The clients, their checks and the samples of one run."""

    def __init__(self, url: str, corpus: dict[str, bytes]) -> None:
        self.url, self.corpus = url, corpus
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.expected: dict[str, tuple[int, str | None]] = {}
        self.lock = threading.Lock()
        self.image = "data:image/png;base64," + base64.b64encode(page_png()).decode()
        self.pdf = one_page_pdf()

    def fail(self, what: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(what)

    def client(self, key: str, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": KEYS[key]}, timeout=timeout)

    def send(self, http: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
        """A request, sent again after its ``Retry-After`` (at most 10 s, 5 tries) while it is
        answered ``429``, as MinerU's client does: a full queue is an answer to wait on, not a failure."""
        for _ in range(5):
            response = http.request(method, url, **kwargs)
            if response.status_code != 429:
                return response
            self.counts["retried_429"] += 1
            time.sleep(min(10.0, float(response.headers.get("Retry-After", "1"))))
        return response

    def check(self, kind: str, response: httpx.Response, ok: tuple[int, ...] = (200,)) -> None:
        self.counts[f"{kind}:{response.status_code}"] += 1
        if response.status_code not in ok:
            self.fail(f"{kind}: {response.status_code} {response.text[:200]}")

    # -- the mix ---------------------------------------------------------------------------------
    def parse(self, http: httpx.Client, rng: random.Random) -> None:
        name = rng.choice(sorted(self.corpus))
        files = {"file": (name, self.corpus[name])}
        response = self.send(http, "POST", "/v1/document/parse", files=files, data={"pages": "1-2"})
        code = response.json().get("error", {}).get("code") if response.status_code >= 400 else None
        seen = (response.status_code, code)
        with self.lock:
            first = self.expected.setdefault(name, seen)
        self.counts[f"parse:{response.status_code}"] += 1
        if response.status_code >= 500 or seen != first:
            self.fail(f"parse {name}: {seen}, first {first}: {response.text[:200]}")

    def chat_body(self, stream: bool) -> dict:
        user = [
            {"type": "image_url", "image_url": {"url": self.image}},
            {"type": "text", "text": "\nText Recognition:"},
        ]
        return {"model": "mineru", "messages": [{"role": "user", "content": user}], "max_tokens": 16, "stream": stream}

    def chat(self, http: httpx.Client, rng: random.Random) -> None:
        self.check("chat", self.send(http, "POST", "/v1/chat/completions", json=self.chat_body(False)))

    def chat_stream(self, http: httpx.Client, rng: random.Random) -> None:
        with http.stream("POST", "/v1/chat/completions", json=self.chat_body(True)) as response:
            body = b"".join(response.iter_bytes())
        self.check("chat_stream", response)
        if response.status_code == 200 and not body.rstrip().endswith(b"data: [DONE]"):
            self.fail(f"chat_stream: no [DONE]: {body[-200:]!r}")

    def chat_abandon(self, http: httpx.Client, rng: random.Random) -> None:
        try:
            http.post("/v1/chat/completions", json=self.chat_body(False), timeout=0.2)
            self.counts["chat_abandon:answered"] += 1
        except httpx.TimeoutException:
            self.counts["chat_abandon:left"] += 1

    def upload_job(self, http: httpx.Client, rng: random.Random) -> None:
        data = self.pdf + f"% {rng.random()}\n".encode()  # bytes of its own: each upload is PUT
        declared = {"filename": "soak.pdf", "bytes": len(data), "mime_type": "application/pdf"}
        declared["sha256sum"] = hashlib.sha256(data).hexdigest()
        created = self.send(http, "POST", "/v1/uploads", json=declared)
        self.check("upload", created)
        if created.status_code != 200:
            return
        body = created.json()
        if body["status"] != "completed":
            self.check(
                "upload_put", self.send(http, "PUT", body["upload_url"], content=data, headers=body["upload_headers"])
            )
            done = self.send(http, "POST", f"/v1/uploads/{body['id']}/complete")
            self.check("upload_complete", done)
            if done.status_code != 200:
                return
            body = done.json()
        file_id = body["file"]["id"]
        source = {"source": {"type": "file_id", "file_id": file_id}}
        job = self.send(http, "POST", "/v1/parse/jobs", json={"files": [source], "output_formats": ["markdown"]})
        self.check("parse_job", job, (202,))
        if job.status_code != 202:
            return
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            state = self.send(http, "GET", f"/v1/parse/jobs/{job.json()['job_id']}").json()
            if state["status"] not in ("queued", "running"):
                self.counts[f"parse_job:{state['status']}"] += 1
                if state["status"] != "completed":
                    self.fail(f"parse job {state['status']}: {json.dumps(state)[:300]}")
                return
            time.sleep(0.5)
        self.fail("parse job did not end in 600 s")

    def task_raw(self, http: httpx.Client, rng: random.Random) -> None:
        headers = {"Content-Type": "application/octet-stream"}
        response = self.send(
            http, "POST", "/v1/tasks", content=self.pdf, params={"filename": "raw.pdf"}, headers=headers
        )
        self.check("task_raw", response, (200, 202))

    def put_cut(self, http: httpx.Client, rng: random.Random) -> None:
        declared = {"filename": "cut.pdf", "bytes": 4096, "mime_type": "application/pdf"}
        created = http.post("/v1/uploads", json=declared)
        self.check("put_cut_declare", created)
        if created.status_code != 200:
            return
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            head = (
                f"PUT /v1/uploads/{created.json()['id']}/content HTTP/1.1\r\nHost: {host}\r\n"
                f"X-API-Key: {http.headers['X-API-Key']}\r\nContent-Length: 4096\r\n\r\n"
            )
            sock.sendall(head.encode() + b"x" * 1000)  # then gone, 3,096 bytes short
        self.counts["put_cut:sent"] += 1

    def bad_key(self, http: httpx.Client, rng: random.Random) -> None:
        response = httpx.get(f"{self.url}/v1/health", headers={"X-API-Key": "wrong-key-0000000"}, timeout=30)
        self.check("bad_key", response, (401,))

    def run_client(self, index: int, until: float) -> None:
        rng = random.Random(index)
        kinds = [kind for kind, weight in MIX.items() for _ in range(weight)]
        with self.client("alpha" if index % 2 == 0 else "beta") as http:
            while time.monotonic() < until:
                kind = rng.choice(kinds)
                try:
                    getattr(self, kind)(http, rng)
                except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
                    self.fail(f"{kind}: {type(exc).__name__}: {exc}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauges(url: str) -> dict[str, float]:
    wanted = (
        "mineru_fast_jobs_in_flight", "mineru_fast_queue_length", "mineru_fast_chat_generations_in_flight",
        "mineru_fast_chat_requests_in_flight", "mineru_fast_request_body_bytes_in_flight",
        "mineru_fast_upload_bytes_held", "mineru_fast_upload_records",
    )  # fmt: skip
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--shared", type=Path, default=Path(__file__).resolve().parents[2] / "shared")
    ap.add_argument("--rss-growth-mb", type=float, default=150.0)
    ap.add_argument("--health-p99-ms", type=float, default=1000.0)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    corpus = {name: (args.shared / "corpus" / name).read_bytes() for name in CORPUS_FILES}
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    model = args.model
    if model is None:
        model = work / "tiny"
        subprocess.run([sys.executable, "-m", "mineru_fast", "synth-model", "--size", "tiny", str(model)], check=True)
    (work / "keys.txt").write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "mineru_fast", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--model", str(model), "--preset", "fast", "--max-new-tokens", BOUNDS, "--workers", "2"]
    command += ["--api-key-file", str(work / "keys.txt"), "--rate-limit", "100000", "--result-ttl", "120"]
    command += ["--drain-timeout", "120", "--chat-orphan-grace", "2"]
    log = (work / "server.log").open("wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            sys.exit(f"soak: the server ended at start-up; see {work / 'server.log'}")
        time.sleep(0.5)
    soak = Soak(url, corpus)
    started = time.monotonic()
    until = started + args.minutes * 60
    clients = [threading.Thread(target=soak.run_client, args=(i, until)) for i in range(args.clients)]
    for thread in clients:
        thread.start()
    samples: list[tuple[float, float, float]] = []  # (minutes, RSS MB, /health ms)
    while any(thread.is_alive() for thread in clients):
        began = time.perf_counter()
        health = httpx.get(f"{url}/health", timeout=30).status_code
        took = (time.perf_counter() - began) * 1000
        if health != 200:
            soak.fail(f"/health {health}")
        samples.append(((time.monotonic() - started) / 60, rss_mb(server.pid), took))
        time.sleep(10)
    for thread in clients:
        thread.join()
    settle = time.monotonic() + 240  # past --result-ttl (120 s): the flow's files expire too
    while True:  # the abandoned chats' orphans, the cut uploads' records, the last jobs
        state = gauges(url)
        busy = [k for k, v in state.items() if v]
        if not busy or time.monotonic() > settle:
            break
        time.sleep(1)
    for name in busy:
        soak.fail(f"{name} = {state[name]} after the load ended")
    server.send_signal(signal.SIGTERM)
    began = time.monotonic()
    try:
        code = server.wait(timeout=180)
    except subprocess.TimeoutExpired:
        server.kill()
        code = None
    drain_s = time.monotonic() - began
    if code != 0:
        soak.fail(f"drain: exit code {code}")
    fifth = args.minutes / 5
    second = [s[1] for s in samples if fifth <= s[0] < 2 * fifth] or [samples[0][1]]
    last = [s[1] for s in samples if s[0] >= 4 * fifth] or [samples[-1][1]]
    growth = statistics.median(last) - statistics.median(second)
    health_ms = sorted(s[2] for s in samples)
    p99 = health_ms[min(len(health_ms) - 1, int(0.99 * len(health_ms)))]
    if growth > args.rss_growth_mb:
        soak.fail(f"RSS drifted {growth:.0f} MB after warm-up (bound {args.rss_growth_mb:g})")
    if p99 > args.health_p99_ms:
        soak.fail(f"/health p99 {p99:.0f} ms (bound {args.health_p99_ms:g})")
    report = {
        "minutes": args.minutes, "clients": args.clients, "requests": sum(soak.counts.values()),
        "counts": dict(sorted(soak.counts.items())), "expected_by_file": {k: list(v) for k, v in soak.expected.items()},
        "rss_mb": {"start": samples[0][1], "median_second_fifth": statistics.median(second),
                   "median_last_fifth": statistics.median(last), "max": max(s[1] for s in samples),
                   "end": samples[-1][1], "drift_after_warmup": growth},
        "health_ms": {"p50": statistics.median(health_ms), "p99": p99, "max": health_ms[-1]},
        "gauges_after": state, "drain_s": drain_s, "exit_code": code, "failures": soak.failures,
        "server_log": str(work / "server.log"),
    }  # fmt: skip
    text = json.dumps(report, indent=1)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 1 if soak.failures else 0


if __name__ == "__main__":
    sys.exit(main())
