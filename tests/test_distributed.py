"""Scale-out on Ray: ``mineru-fast batch`` and the Ray Serve service on a simulated two-node
cluster (``ray.cluster_utils.Cluster``, two nodes of 1 CPU each, shared by every test here)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from batch_outputs import output_tree
from samples import pdf_bytes, sample_trace, text_page

from mineru_fast.cli.main import main
from mineru_fast.distributed.manifest import MANIFEST, Manifest

ray = pytest.importorskip("ray")
# Starting the two-node cluster alone takes ~18 s on 2 loaded cores; each test here is over 15 s.
pytestmark = pytest.mark.slow

from mineru_fast.distributed.batch import PARTIAL, BatchConfig, run_batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# documents and their page counts: replay traces make every page "success", whatever the weights
DOCUMENTS = {"a_one.png": 1, "b_three.pdf": 3, "c_one.png": 1, "e_five.pdf": 5}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def make_collection(folder: Path, documents: dict[str, int], broken: bool = False) -> tuple[Path, Path]:
    """Write the documents (PNG pages, image-only PDFs) and their traces; returns (inputs, traces)."""
    inputs, traces = folder / "inputs", folder / "traces"
    inputs.mkdir(parents=True)
    traces.mkdir()
    for name, pages in documents.items():
        path = inputs / name
        if path.suffix == ".png":
            text_page(seed=len(name)).save(path)
        else:
            path.write_bytes(pdf_bytes(pages))
        sample_trace(pages).save(traces / f"{path.stem}.json")
    if broken:
        (inputs / "d_broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog >> truncated")
        sample_trace(1).save(traces / "d_broken.json")
    return inputs, traces


def sequential(inputs: Path, traces: Path, out: Path, model: Path) -> Path:
    argv = ["parse", str(inputs), "-o", str(out), "--model", str(model), "--replay", str(traces), "--quiet"]
    main([*argv, "-f", "2.x"])  # these tests compare MinerU 2.x's files, <stem>.json included
    return out


def manifest_lines(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / MANIFEST).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def first_run(cluster, tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("collection")
    inputs, traces = make_collection(folder, DOCUMENTS, broken=True)
    # a file:// URI: the actors list nothing and read each document themselves (pyarrow's filesystem)
    # two pages per task: b_three and e_five are split into tasks that run on both actors
    config = BatchConfig([inputs.as_uri()], folder / "out", str(tiny_model), replay=traces, layout="2.x", actors=2,
                         cores_per_actor=1, pages_per_task=2)  # fmt: skip
    summary = run_batch(config, log=lambda line: None)
    return folder, inputs, traces, summary


def test_a_folder_parses_on_two_nodes_like_sequential_parse(first_run, tiny_model):
    folder, inputs, traces, summary = first_run
    (inputs / "d_broken.pdf").unlink()  # parse refuses a run with an unreadable input up front
    expected = sequential(inputs, traces, folder / "sequential", tiny_model)
    for name, pages in DOCUMENTS.items():
        stem = Path(name).stem
        produced = output_tree(folder / "out" / stem)
        assert produced == output_tree(expected / stem)
        assert len(produced[f"{stem}.json"]["pages"]) == pages  # type: ignore[index]
    assert summary.actors == 2 and summary.pages == 10
    assert not (folder / "out" / PARTIAL).exists()


def test_a_broken_file_is_recorded_while_the_rest_complete(first_run):
    folder, _, _, summary = first_run
    records = {Path(line["document"]).name: line for line in manifest_lines(folder / "out")}
    assert all(line["document"].startswith("file:///") for line in records.values())
    assert sorted(records) == ["a_one.png", "b_three.pdf", "c_one.png", "d_broken.pdf", "e_five.pdf"]
    assert [records[n]["status"] for n in sorted(records)] == ["success", "success", "success", "error", "success"]
    broken = records["d_broken.pdf"]
    assert broken["error"].startswith("CorruptDocument: ") and broken["attempts"] == 1 and broken["pages"] == 0
    assert not (folder / "out" / "d_broken").exists()
    assert summary.exit_status == 1


def test_a_killed_actor_s_document_is_retried_once_and_completes(cluster, tiny_model, tmp_path):
    inputs, traces = make_collection(tmp_path, {"long.pdf": 5, "short.png": 1})
    killed = []

    def kill_mid_document(event):
        if event["document"] == "long" and event["kind"] == "page" and not killed:
            killed.append(event["index"])
            ray.kill(event["actor"], no_restart=False)  # Ray restarts the actor; the document is retried

    out = tmp_path / "out"
    config = BatchConfig([inputs], out, str(tiny_model), replay=traces, layout="2.x", actors=2, cores_per_actor=1)
    summary = run_batch(config, log=lambda line: None, on_event=kill_mid_document)
    assert killed == [0]
    lines = manifest_lines(out)
    assert sorted((line["name"], line["status"], line["attempts"], line["pages"]) for line in lines) == [
        ("long", "success", 2, 5), ("short", "success", 1, 1)
    ]  # fmt: skip
    expected = sequential(inputs, traces, tmp_path / "sequential", tiny_model)
    assert output_tree(out / "long") == output_tree(expected / "long")  # the pages of the killed attempt left no trace
    assert summary.exit_status == 0 and not (out / PARTIAL).exists()


def test_a_task_that_fails_on_every_attempt_makes_its_pages_failures_and_the_document_partial(
    cluster, tiny_model, tmp_path
):
    inputs, traces = make_collection(tmp_path, {"long.pdf": 5})
    kills = []

    def kill_task_1(event):
        if event["kind"] == "page" and event["task"] == 1:  # pages 3-4, on each attempt
            kills.append(event["attempt"])
            ray.kill(event["actor"], no_restart=False)

    out = tmp_path / "out"
    config = BatchConfig([inputs], out, str(tiny_model), replay=traces, layout="2.x", actors=2, cores_per_actor=1,
                         max_retries=1, pages_per_task=2, confidence=True)  # fmt: skip
    summary = run_batch(config, log=lambda line: None, on_event=kill_task_1)
    assert kills == [1, 2] and summary.exit_status == 1
    (line,) = manifest_lines(out)
    assert (line["status"], line["pages"], line["failed_pages"], line["attempts"]) == ("partial", 5, [3, 4], 2)
    assert line["error"].startswith("pages 3-4 failed: Actor")  # ActorDiedError / ActorUnavailableError
    result = json.loads((out / "long" / "long.json").read_text(encoding="utf-8"))
    assert [(p["page_idx"], p["status"]) for p in result["pages"]] == [
        (0, "success"), (1, "success"), (2, "failure"), (3, "failure"), (4, "success")
    ]  # fmt: skip
    assert result["status"] == "partial" and result["pages"][2]["errors"][0]["code"] == "batch_task_failed"
    assert sorted(p.name for p in (out / "long" / "layout").iterdir()) == [
        "page_0001.png", "page_0002.png", "page_0005.png"
    ]  # fmt: skip
    items = json.loads((out / "long" / "long_content_list.json").read_text(encoding="utf-8"))
    assert {item["page_idx"] for item in items} == {0, 1, 4} and all("mf_confidence" in item for item in items)
    assert not (out / PARTIAL).exists()


def test_a_local_document_reaches_the_actors_through_the_ledger_checked_against_its_inspection(cluster, tmp_path):
    """Task rows name a local document instead of carrying its bytes: an actor on any node has the
    ledger read it on the driver's node, where the file is. A file changed or gone since its
    inspection is a ``SourceError`` with its own message (not Ray's wrapper of it)."""
    from mineru_fast.distributed.batch import _document_bytes, _inspect, _item, _Job, _Ledger, _row
    from mineru_fast.distributed.sources import Source
    from mineru_fast.errors import SourceError

    path, data = tmp_path / "doc.pdf", pdf_bytes(3)
    path.write_bytes(data)
    task = _item(_inspect(_row(_Job(Source(str(path), str(path)), "doc")), None, None, None, 2, 100)[0])
    ledger = ray.remote(num_cpus=0)(_Ledger).remote()
    try:
        assert task.pages == "1-2" and _document_bytes(task, ledger) == data
        path.write_bytes(pdf_bytes(4))
        with pytest.raises(SourceError, match=r"doc\.pdf changed since it was inspected \(its SHA-256 differs\)$"):
            _document_bytes(task, ledger)
        path.unlink()
        with pytest.raises(SourceError, match=r"^cannot read .*doc\.pdf: \[Errno 2\]") as missing:
            _document_bytes(task, ledger)
    finally:
        ray.kill(ledger)
    assert type(missing.value) is SourceError


def test_resume_after_an_interrupted_run_parses_only_what_is_left(cluster, tiny_model, tmp_path):
    documents = {"a_one.png": 1, "b_long.pdf": 6, "c_one.png": 1}
    inputs, traces = make_collection(tmp_path, documents)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "mineru_fast", "batch", str(inputs), "-o", str(out), "--model", str(tiny_model),
            "--replay", str(traces), "--ray-address", cluster.address, "--actors", "1",
            "--cores-per-actor", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900  # a bound, not a wait: it failed at 120 s on a machine 3x oversubscribed
    while not ((out / MANIFEST).is_file() and manifest_lines(out)) and time.monotonic() < deadline:
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)  # the driver dies mid-run; its actor goes with it
    driver.wait(timeout=30)
    done_before = Manifest(out).complete()
    assert done_before and len(done_before) < len(documents)

    # MinerU 4's bundle (the default): a complete document has its middle_json.json in place
    summary = run_batch(BatchConfig([inputs], out, str(tiny_model), replay=traces, actors=1, cores_per_actor=1,
                                    resume=True), log=lambda line: None)  # fmt: skip
    parsed_now = {record.name for record in summary.records}
    assert {Path(source).stem for source in summary.skipped} == done_before
    assert parsed_now == {Path(name).stem for name in documents} - done_before
    assert all(record.status == "success" for record in summary.records)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "a_one", "b_long", "c_one"])


def _processes_naming(text: str) -> list[int]:
    """Ids of the processes whose environment holds ``text`` (Ray's workers rename their command
    line, not their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # ended meanwhile
            continue
    return found


def test_a_killed_driver_takes_its_local_ray_with_it(tiny_model, tmp_path):
    """Ray's dashboard and runtime-env agents kept running, adopted by init, after the batch
    driver was killed (SIGTERM and SIGINT run Ray's shutdown; SIGKILL runs nothing)."""
    import tempfile

    inputs, traces = make_collection(tmp_path, {"long.pdf": 8})
    ray_dir = tempfile.mkdtemp(prefix="mfray", dir="/tmp")  # short: Ray's socket paths have a length limit
    log = tmp_path / "driver.log"
    argv = [sys.executable, "-m", "mineru_fast", "batch", str(inputs), "-o", str(tmp_path / "out"),
            "--model", str(tiny_model), "--replay", str(traces), "--actors", "1", "--cores-per-actor", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["RAY_TMPDIR"] = ray_dir
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as err:
        driver = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while "actor(s) x" not in log.read_text() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.poll() is None and _processes_naming(ray_dir), log.read_text()[-2000:]  # Ray runs
        driver.kill()
        assert driver.wait(timeout=120) == -signal.SIGKILL
        deadline = time.monotonic() + 120  # the reaper's grace (10 s) and its kills, on a loaded machine
        while _processes_naming(ray_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_naming(ray_dir) == []
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _processes_naming(ray_dir):  # what this test started and outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- the service on Ray Serve: two replicas (one per node), one job store -------------------------

KEY = "secret-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def serve_url(cluster, tiny_model, tmp_path_factory):
    from ray import serve

    from mineru_fast.distributed.serve_app import build_app
    from mineru_fast.serve.config import ServeConfig

    keys = tmp_path_factory.mktemp("serve") / "keys"
    keys.write_text(f"tester:{KEY}\n")
    port = 18000 + os.getpid() % 1000
    config = ServeConfig(model=str(tiny_model), workers=2, allow_replay=True, api_key_file=keys, port=port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(config, replicas=2, cores_per_replica=1), name="mineru-fast", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


class Recorder(httpx.BaseTransport):
    """An httpx transport that opens a new connection per request, so the kernel spreads them over
    both nodes' Serve proxies (each routes to the replica on its node), and records which replica
    answered each request (``X-Replica-ID``)."""

    def __init__(self) -> None:
        self.transport = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))
        self.answers: list[tuple[str, str, int, str | None]] = []
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.transport.handle_request(request)
        with self.lock:
            self.answers.append((request.method, request.url.path, response.status_code,
                                 response.headers.get("x-replica-id")))  # fmt: skip
        return response

    def close(self) -> None:
        self.transport.close()


def ready_replicas(url: str, timeout: float = 240) -> set[str]:
    """Poll ``/ready`` on fresh connections until two replicas answered 200; their ids."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < 2 and time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/ready", timeout=30)
        except httpx.TransportError:
            response = None
        if response is not None and response.status_code == 200:
            seen.add(response.headers["x-replica-id"])
        time.sleep(0.1)
    assert len(seen) == 2, seen
    return seen


def replay_files(pages: int) -> dict:
    """The upload of a ``pages``-page document with its replay trace, asking for the parts
    ``check_results`` compares (the service's default is MinerU 4's markdown + middle JSON)."""
    return {"file": ("doc.pdf", pdf_bytes(pages)),
            "replay": ("t.json", json.dumps(sample_trace(pages).to_dict()).encode()),
            "formats": (None, "markdown,content_list")}  # fmt: skip


@pytest.fixture(scope="module")
def expected_parse(tiny_model):
    """``pages -> (markdown, content_list)`` of a sequential parse of ``pdf_bytes(pages)``, replayed."""
    from mineru_fast.options import ParserOptions
    from mineru_fast.pipeline.parser import DocumentParser

    parser = DocumentParser.from_pretrained(str(tiny_model), ParserOptions(threads=1))
    cache: dict[int, tuple[str, list]] = {}

    def expected(pages: int) -> tuple[str, list]:
        if pages not in cache:
            document = parser.parse(pdf_bytes(pages), replay=sample_trace(pages))
            cache[pages] = (document.to_markdown(), document.to_content_list())
        return cache[pages]

    yield expected
    parser.close()


def submit_jobs(url: str, page_counts: list[int]) -> dict[str, tuple[int, str]]:
    """``POST /v1/jobs`` each document twice at once under one ``Idempotency-Key`` (a client's retry
    racing its first try, on either replica): one job each; ``job_id -> (pages, replica that made it)``."""

    def post(files: dict, headers: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/jobs", files=files, headers=headers, timeout=60)

    jobs = {}
    with ThreadPoolExecutor(2) as pool:
        for pages in page_counts:
            files, headers = replay_files(pages), {**HEADERS, "Idempotency-Key": str(uuid.uuid4())}
            answers = list(pool.map(post, [files] * 2, [headers] * 2))
            assert [a.status_code for a in answers] == [202, 202], [a.text for a in answers]
            assert answers[0].json()["job_id"] == answers[1].json()["job_id"]
            made = [a for a in answers if "idempotent-replayed" not in a.headers]
            assert len(made) == 1, [dict(a.headers) for a in answers]
            jobs[made[0].json()["job_id"]] = (pages, made[0].headers["x-replica-id"])
    return jobs


def check_results(results: dict[str, dict], jobs: dict[str, tuple[int, str]], expected_parse) -> None:
    for job_id, (pages, _) in jobs.items():
        result = results[job_id]
        assert (result["job_id"], result["status"], result["page_count"]) == (job_id, "success", pages)
        assert (result["markdown"], result["content_list"]) == expected_parse(pages)


def test_ray_serve_jobs_are_answered_by_either_replica(serve_url, expected_parse):
    from mineru_fast.client import Client

    replicas = ready_replicas(serve_url)
    jobs = submit_jobs(serve_url, [2, 3, 4, 5])  # distinct documents: a mixed-up result shows
    recorder = Recorder()
    with Client(serve_url, api_key=KEY, poll_interval=0.1, transport=recorder) as client:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = dict(zip(jobs, pool.map(lambda job_id: client.wait(job_id, timeout=300), jobs), strict=True))
    check_results(results, jobs, expected_parse)
    for job_id, (_, owner) in jobs.items():
        polled_by = {replica for method, path, status, replica in recorder.answers if path == f"/v1/jobs/{job_id}"}
        assert polled_by == replicas, (owner, polled_by)  # the replica that does not run it answered too
    assert {status for _, _, status, _ in recorder.answers} == {200}


def test_ray_serve_a_killed_replica_s_jobs_end_once_on_a_surviving_one(serve_url, expected_parse):
    from mineru_fast.client import Client, RetryPolicy

    ready_replicas(serve_url)
    jobs = submit_jobs(serve_url, [6, 7, 5, 4])
    victim_job, victim = None, None
    deadline = time.monotonic() + 240
    while victim is None and time.monotonic() < deadline:  # a job one page into its parse
        for job_id, (_, owner) in jobs.items():
            status = httpx.get(f"{serve_url}/v1/jobs/{job_id}", headers=HEADERS, timeout=30).json()
            if status["status"] == "running" and status["pages"]["done"] >= 1:
                victim_job, victim = job_id, owner
                break
        time.sleep(0.05)
    assert victim is not None
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(actors) == 1 and "SERVE_REPLICA" in actors[0]["name"]
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)

    recorder = Recorder()
    # polls cut by the dying replica get Serve's plain-text 500: the client retries them
    retries = RetryPolicy(attempts=30, backoff=0.2, max_backoff=2.0)
    with Client(serve_url, api_key=KEY, poll_interval=0.2, retries=retries, transport=recorder) as client:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = dict(zip(jobs, pool.map(lambda job_id: client.wait(job_id, timeout=400), jobs), strict=True))
            statuses = {job_id: client.job(job_id) for job_id in jobs}
    check_results(results, jobs, expected_parse)  # one result each, under the id it was submitted with
    # taken over once (by one replica: claims are serialized in the store), parsed again from the
    # stored upload, and its one result is the survivor's
    assert statuses[victim_job]["attempts"] == 2
    for job_id, (_, owner) in jobs.items():  # the victim's other jobs too, unless done before the kill
        assert statuses[job_id]["attempts"] in ((1, 2) if owner == victim else (1,))


def test_ray_serve_synchronous_requests_are_answered_when_a_replica_is_killed(serve_url):
    url = serve_url
    ready_replicas(url)
    refused = httpx.post(f"{url}/v1/document/parse", files={"file": ("x.pdf", pdf_bytes(1))})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"

    def request(pages: int) -> tuple[int, list]:
        files = replay_files(pages)
        answers = []
        # A client's retries. Serve's proxy answers 500 (plain text) for a request whose replica
        # died under it: the request never reached a result, so sending it again parses it once.
        for _ in range(20):
            response = httpx.post(f"{url}/v1/document/parse", files=files, headers=HEADERS, timeout=120)
            answers.append(response.status_code)
            if response.status_code == 200:
                return pages, [answers, response.json()]
            time.sleep(1)
        return pages, [answers, None]

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(request, n) for n in (3, 4, 5, 3, 4, 5)]
        time.sleep(1.5)  # requests are in flight on both replicas
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
        assert len(replicas) == 2
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        results = [f.result() for f in futures]
    for pages, (answers, body) in results:
        assert body is not None, answers
        assert body["status"] == "success" and body["page_count"] == pages
