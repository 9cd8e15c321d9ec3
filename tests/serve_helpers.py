"""Start the real ``mineru-fast serve`` in a subprocess on 127.0.0.1 for tests (and benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = Path(os.environ.get("MINERU_FAST_SHARED", REPO.parent / "shared")) / "workloads" / "omnidocbench_demo"
# Random weights never emit a valid layout, so bounded steps keep each free-decoded page short.
BOUNDS = "layout=24,text=8,table=8,equation=8"


def wait_for(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition()`` until true or ``timeout`` s passed (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running server: its URL, process and JSON-lines log file."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line]

    def log_records(self) -> list[dict]:
        records = []
        for line in self.log_lines():
            try:
                records.append(json.loads(line))
            except ValueError:  # not JSON, or a line still being written
                continue
        return records

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL after ``timeout`` s; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


def wait_ready(server: Server, timeout: float) -> dict:
    """Poll ``/ready`` until it answers 200 (bounded); returns its JSON.

    Raises:
        RuntimeError: the process exited or ``timeout`` passed (the log tail is in the message).
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.process.returncode}:\n" + "\n".join(server.log_lines()[-20:])
            )
        try:
            response = httpx.get(f"{server.url}/ready", timeout=2.0)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s:\n" + "\n".join(server.log_lines()[-20:]))


@contextmanager
def running_server(
    model: Path,
    log_dir: Path,
    *args: str,
    ready_timeout: float = 180.0,
    open_files: int | None = None,
    python: str = sys.executable,
) -> Iterator[Server]:
    """Run ``mineru-fast serve`` on a free loopback port until the block exits.

    Args:
        model: model directory.
        log_dir: where ``server.log`` (the server's stderr) goes.
        args: extra ``serve`` arguments.
        ready_timeout: seconds to wait for ``/ready``.
        open_files: the server process's open-file limit (soft and hard), if given.
        python: the interpreter that runs it (one with mineru-fast's dependencies).
    """
    server = start_server(model, log_dir, *args, open_files=open_files, python=python)
    try:
        wait_ready(server, ready_timeout)
        yield server
    finally:
        server.stop()


def start_server(
    model: Path, log_dir: Path, *args: str, open_files: int | None = None, python: str = sys.executable
) -> Server:
    """Start ``mineru-fast serve`` on a free loopback port (not waiting for it); see ``running_server``."""
    port = free_port()
    command = [
        python,
        "-m",
        "mineru_fast.cli.main",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--preset",  # what users serve; the exact preset's bf16 weights upcast per call cost the tiny
        "fast",  # model's tests more (a later --preset in args wins)
        "--threads",
        "1",  # 2 spinning intra-op threads slow down ~10x when the test process needs a core too
        *args,
    ]
    log_path = log_dir / f"server-{port}.log"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}  # this checkout, whichever interpreter

    def limit_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            preexec_fn=limit_files if open_files else None,
        )
    return Server(f"http://127.0.0.1:{port}", process, log_path)


def assert_error(response, status: int, code: str) -> dict:
    """The service's error shape (``errors.error_body``) with ``status`` and ``code``; returns the error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "request_id"}
    assert body["error"]["code"] == code and body["error"]["message"]
    assert body["error"]["request_id"] == response.headers["x-request-id"]
    return body["error"]


def read_response_head(sock) -> bytes:
    """What a raw socket receives up to the end of a response's headers (at most 64 KiB, or until
    the server closes)."""
    reply = b""
    while b"\r\n\r\n" not in reply and len(reply) < 65536:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    return reply


def workload_page_with_text(traces_dir: Path, max_bytes: int):
    """The workload image under ``max_bytes`` with text blocks and the least replayed output.

    Returns:
        ``(image_path, trace_path, blocks, page_trace)``, or None if there is none.
    """
    from mineru_fast.protocol.traces import layout_lines, load_trace

    candidates = []
    for image in sorted((WORKLOAD / "images").iterdir()):
        if image.stat().st_size > max_bytes:
            continue
        trace_path = traces_dir / f"{image.name.rsplit('.', 1)[0]}.json"
        trace = load_trace(trace_path).pages[0]
        blocks = layout_lines(trace.layout)
        if any(b.type in ("text", "title") and c and c.strip() for b, c in zip(blocks, trace.contents, strict=True)):
            cost = len(trace.layout) + sum(len(c or "") for c in trace.contents)
            candidates.append((cost, image.name, (image, trace_path, blocks, trace)))
    return min(candidates)[2] if candidates else None
