"""The parts of ``mineru-fast batch`` that need no Ray: the actor body, a document assembled from
page-range tasks, the manifest, the job plan, the input listing (local paths and ``file://`` URIs
through pyarrow)."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
from batch_outputs import output_tree
from samples import pdf_bytes, sample_trace, text_page

from mineru_fast.distributed.assembly import PARTIAL, TASK_FAILED, DocumentAssembly, page_spec, split_pages
from mineru_fast.distributed.batch import BatchError, plan_jobs
from mineru_fast.distributed.manifest import Manifest, Record
from mineru_fast.distributed.sources import Source, list_sources
from mineru_fast.distributed.worker import DocumentWorker, inspect_document
from mineru_fast.errors import CorruptDocument, SourceError
from mineru_fast.options import ParserOptions
from mineru_fast.results.page import Page, ParseError

needs_pyarrow = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="URI inputs need pyarrow (the ray extra)"
)


@needs_pyarrow
def test_the_worker_streams_each_page_with_its_image_files(tiny_model, tmp_path):
    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1)
    seen: list[dict] = []
    try:
        events = list(worker.parse(pdf_bytes(2), trace=sample_trace(2)))
        gathered = worker.run_task(pdf_bytes(2), trace=sample_trace(2), on_page=seen.append)
        broken = list(worker.parse(b"%PDF-1.7 cut short"))
        broken_task = worker.run_task(b"%PDF-1.7 cut short")
        with pytest.raises(CorruptDocument):
            inspect_document("bad", b"%PDF-1.7 cut short")
        (tmp_path / "doc.pdf").write_bytes(pdf_bytes(3))
        (uri_source,) = list_sources([(tmp_path / "doc.pdf").as_uri()])
        info = inspect_document("doc", uri_source, pages="2-3")  # the inspection task reads the file
        metadata = worker.parser.result_metadata(info)
        from_uri = list(worker.parse(uri_source, trace=sample_trace(3), pages="2"))  # the actor reads the file
        missing = list(worker.parse(Source("file:///gone.pdf", "/gone.pdf", uri_source.filesystem)))
    finally:
        worker.parser.close()
    assert [(e["kind"], e.get("index"), e.get("status")) for e in events] == [
        ("page", 0, "success"), ("page", 1, "success"), ("done", None, None)
    ]  # fmt: skip
    assert [sorted(e["files"]) for e in events[:2]] == [
        ["images/page_0_image_2.jpg", "layout/page_0001.png"],
        ["images/page_1_image_2.jpg", "layout/page_0002.png"],
    ]
    page = events[0]["page"]
    assert page.index == 0 and page.image is None and page.crops == {} and page.blocks  # its record only
    assert [e["kind"] for e in broken] == ["error"] and broken[0]["error"].startswith("CorruptDocument: ")
    assert [page.index for page in gathered["pages"]] == [0, 1]  # one task's pages, gathered
    assert gathered["files"] == {**events[0]["files"], **events[1]["files"]}
    assert [(e["index"], e["files"], e["page"]) for e in seen] == [(0, None, None), (1, None, None)]
    assert broken_task["error"].startswith("CorruptDocument: ")
    assert info.pages == (1, 2) and metadata["input"]["pages"] == [1, 2]
    assert metadata["input"]["name"] == "doc"
    assert [(e["kind"], e.get("index")) for e in from_uri] == [("page", 1), ("done", None)]
    assert from_uri[0]["files"] == events[1]["files"]  # the same page, the same bytes
    assert [e["kind"] for e in missing] == ["error"] and missing[0]["error"].startswith("SourceError: cannot read")
    assert worker.describe() == {"host": worker.describe()["host"], "threads": 1, "cpus": None, "node": None}


def run_task(worker: DocumentWorker, assembly: DocumentAssembly, index: int, data: bytes, trace, attempt: int = 1):
    """What the driver does with one task: stage its files, hand its pages over when it is done."""
    staged = assembly.staging(index, attempt)
    pages = []
    for event in worker.parse(data, trace=trace, pages=page_spec(assembly.tasks[index])):
        if event["kind"] == "page":
            for rel, blob in event["files"].items():
                (staged / rel).parent.mkdir(parents=True, exist_ok=True)
                (staged / rel).write_bytes(blob)
            pages.append(event["page"])
    return assembly.complete(index, pages, staged, attempt)


def test_a_document_split_into_tasks_is_written_as_sequential_parse_writes_it(tiny_model, tmp_path):
    from mineru_fast.cli.main import main

    (tmp_path / "in").mkdir()
    (tmp_path / "traces").mkdir()
    source = tmp_path / "in" / "doc.pdf"
    source.write_bytes(pdf_bytes(5))
    trace = sample_trace(5)
    trace.save(tmp_path / "traces" / "doc.json")
    assert main(["parse", str(source), "-o", str(tmp_path / "sequential"), "--model", str(tiny_model),
                 "--replay", str(tmp_path / "traces"), "--quiet"]) == 0  # fmt: skip
    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1, overlays=False)  # the bundle
    try:
        info = inspect_document("doc", source.read_bytes())
        tasks = split_pages(list(info.pages), 2)
        assert tasks == [[0, 1], [2, 3], [4]] and [page_spec(t) for t in tasks] == ["1-2", "3-4", "5"]
        assembly = DocumentAssembly(tmp_path / "out", "doc", tasks, worker.parser.result_metadata(info))
        done = [run_task(worker, assembly, i, source.read_bytes(), trace) for i in (2, 0, 1)]  # out of order
    finally:
        worker.parser.close()
    assert done == [False, False, True]
    assert assembly.finish(wall_s=1.0) == ("success", 5)
    assert output_tree(tmp_path / "out" / "doc") == output_tree(tmp_path / "sequential" / "doc")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [PARTIAL, "doc"]
    assert list((tmp_path / "out" / PARTIAL).iterdir()) == []  # the tasks' folders are gone


def test_a_task_that_failed_on_every_attempt_leaves_failure_pages_never_a_complete_document(tmp_path):
    tasks = [[0], [1, 2], [3]]
    assembly = DocumentAssembly(tmp_path, "doc", tasks, {"schema_version": "x"})
    staged = assembly.staging(2, 1)
    (staged / "images").mkdir()
    (staged / "images" / "page_3_image_0.jpg").write_bytes(b"jpeg")
    assert not assembly.complete(2, [Page(3, blocks=[])], staged, 1)
    assert not assembly.fail(1, "ActorDiedError: killed", 3)
    assert not (tmp_path / PARTIAL / "doc" / "task.2.1").exists()
    assert assembly.complete(0, [Page(0)], assembly.staging(0, 2), 2)
    assert assembly.failed_pages == [1, 2] and assembly.attempts == 3 and not assembly.all_failed
    assert assembly.finish(wall_s=2.0) == ("partial", 4)
    # MinerU 4's bundle: mineru-fast's record of the document is the middle JSON's extension
    result = json.loads((tmp_path / "doc" / "middle_json.json").read_text())["extensions"]["mineru_fast"]
    assert [(p["page_idx"], p["status"]) for p in result["pages"]] == [
        (0, "success"), (1, "failure"), (2, "failure"), (3, "success")
    ]  # fmt: skip
    assert result["pages"][1]["errors"] == [
        {"code": TASK_FAILED, "message": "pages 2-3 failed on every attempt: ActorDiedError: killed", "page": 1}
    ]
    assert (tmp_path / "doc" / "images" / "page_3_image_0.jpg").read_bytes() == b"jpeg"
    everything_failed = DocumentAssembly(tmp_path, "lost", [[0, 1]], {})
    assert everything_failed.fail(0, "ActorDiedError: killed", 3) and everything_failed.all_failed
    everything_failed.discard()
    assert not (tmp_path / PARTIAL / "lost").exists() and not (tmp_path / "lost").exists()


def test_pages_that_parsed_without_success_name_their_first_problem_for_the_manifest(tmp_path):
    unreadable = ParseError("layout_unreadable", "layout output holds no valid block", 1)
    assembly = DocumentAssembly(tmp_path, "doc", [[0], [1, 2], [3]], {"schema_version": "x"})
    assert not assembly.complete(
        1, [Page(1, status="failure", errors=[unreadable]), Page(2)], assembly.staging(1, 1), 1
    )
    assert not assembly.fail(2, "ActorDiedError: killed", 3)  # a failed task stays apart: failed_pages
    assert assembly.problem is None  # nothing taken before task 0 is in
    assert assembly.complete(
        0, [Page(0, status="partial", warnings=["block 2 cut (length)"])], assembly.staging(0, 1), 1
    )
    assert assembly.problem == "page 1: block 2 cut (length) (and 1 more page(s))"
    assert assembly.problem_pages[1] == (1, "layout_unreadable: layout output holds no valid block")
    assert assembly.failed_pages == [3] and assembly.finish(wall_s=1.0) == ("partial", 4)
    clean = DocumentAssembly(tmp_path, "clean", [[0]], {})
    assert clean.complete(0, [Page(0)], clean.staging(0, 1), 1) and clean.problem is None


def test_the_manifest_keeps_each_documents_last_record_and_checks_outputs(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.append(Record("in/a.pdf", "a", "error", 0, "ActorDiedError: killed", 3, 9.0))
    manifest.append(Record("in/a.pdf", "a", "success", 2, None, 1, 4.0))
    manifest.append(Record("in/b.pdf", "b", "partial", 1, None, 1, 2.0))
    manifest.append(Record("in/c.pdf", "c", "error", 0, "CorruptDocument: x", 1, 0.0))
    manifest.append(Record("in/e.pdf", "e", "partial", 4, "pages 2 failed: x", 3, 5.0, failed_pages=[2]))
    with manifest.path.open("a") as out:
        out.write('{"document": "in/d.pdf", "na')  # a line cut by a crash
    assert manifest.records()["a"].status == "success" and len(manifest.records()) == 4
    assert manifest.records()["e"].failed_pages == [2] and manifest.records()["a"].failed_pages == []
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "a.json").write_text("{}")
    assert manifest.complete() == {"a"}  # b has no outputs on disk, c never parsed


def test_a_record_after_a_torn_last_line_is_kept(tmp_path):
    """The next record was written onto the torn line and lost with it: ``--resume`` parsed the
    document again."""
    manifest = Manifest(tmp_path)
    manifest.append(Record("in/a.pdf", "a", "success", 2, None, 1, 4.0))
    with manifest.path.open("a") as out:
        out.write('{"document": "in/d.pdf", "na')  # a line cut by a crash
    manifest.append(Record("in/b.pdf", "b", "success", 1, None, 1, 2.0))
    manifest.append(Record("in/c.pdf", "c", "partial", 1, None, 1, 2.0))
    assert sorted(manifest.records()) == ["a", "b", "c"]
    lines = manifest.path.read_text().splitlines()
    assert len(lines) == 4 and lines[1] == '{"document": "in/d.pdf", "na'


def test_the_job_plan_refuses_clashing_names_and_empty_inputs(tmp_path):
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        text_page().save(tmp_path / folder / "page.png")
    with pytest.raises(BatchError, match="would both write page/"):
        plan_jobs([tmp_path])
    assert [job.name for job in plan_jobs([tmp_path / "x"])] == ["page"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(BatchError, match="no input files"):
        plan_jobs([tmp_path / "empty"])
    with pytest.raises(SourceError, match="no such file or directory"):
        plan_jobs([tmp_path / "missing.pdf"])


@pytest.fixture
def tree_of_inputs(tmp_path):
    """``in/a.pdf``, ``in/b.png``, ``in/notes.txt``, ``in/sub/c.pdf``, ``in/sub/d e.pdf``."""
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    for rel in ("a.pdf", "sub/c.pdf", "sub/d e.pdf"):
        (root / rel).write_bytes(pdf_bytes(1))
    text_page().save(root / "b.png")
    (root / "notes.txt").write_text("not a document")
    return root


@needs_pyarrow
def test_file_uris_list_folders_globs_and_files_through_pyarrow(tree_of_inputs):
    root = tree_of_inputs
    base = root.as_uri()  # file:///.../in
    folder = list_sources([base])
    assert [s.location for s in folder] == [
        f"{base}/a.pdf",
        f"{base}/b.png",
        f"{base}/sub/c.pdf",
        f"file://{root}/sub/d e.pdf",
    ]
    assert [s.stem for s in folder] == ["a", "b", "c", "d e"]
    assert all(type(s.filesystem).__name__ == "LocalFileSystem" for s in folder)  # read by the actor
    assert [s.location for s in list_sources([f"{base}/*.pdf"])] == [f"{base}/a.pdf"]  # * stays in its folder
    assert [s.stem for s in list_sources([f"{base}/*/*.pdf"])] == ["c", "d e"]
    assert [s.stem for s in list_sources([f"{base}/**/*.pdf"])] == ["a", "c", "d e"]  # as a local ** glob
    assert [s.stem for s in list_sources([f"{base}/**/c.pdf"])] == ["c"]
    assert [s.stem for s in list_sources([f"{base}/sub/d%20e.pdf"])] == ["d e"]  # URI escapes decoded
    assert folder[0].read() == (root / "a.pdf").read_bytes()


def test_local_paths_and_globs_are_read_by_the_driver(tree_of_inputs, monkeypatch):
    root = tree_of_inputs
    monkeypatch.chdir(root)
    assert [(s.location, s.filesystem) for s in list_sources(["a.pdf", "sub"])] == [
        ("a.pdf", None), ("sub/c.pdf", None), ("sub/d e.pdf", None)
    ]  # fmt: skip
    assert [s.location for s in list_sources(["**/*.pdf"])] == ["a.pdf", "sub/c.pdf", "sub/d e.pdf"]
    assert list_sources(["*.tiff"]) == []  # a glob that matches nothing names no document
    assert Source("a.pdf", "a.pdf").read() == (root / "a.pdf").read_bytes()
    with pytest.raises(SourceError, match=r"cannot read missing.pdf: \[Errno 2\]"):
        Source("missing.pdf", "missing.pdf").read()


@needs_pyarrow
def test_unsupported_schemes_and_missing_paths_are_typed_errors(tree_of_inputs):
    base = tree_of_inputs.as_uri()
    with pytest.raises(SourceError, match="cannot list nosuch://bucket/x: Unrecognized filesystem type"):
        list_sources(["nosuch://bucket/x"])
    with pytest.raises(SourceError, match=f"no such file or directory: {base}/missing"):
        list_sources([f"{base}/missing"])
    with pytest.raises(SourceError, match="no such file or directory"):
        list_sources([f"{base}/missing/*.pdf"])
    with pytest.raises(SourceError, match="no such file or directory: missing.pdf"):
        list_sources(["missing.pdf"])


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the batch command needs Ray (the ray extra)")
def test_batch_refuses_an_unsupported_scheme_before_it_starts(tmp_path, capsys):
    from mineru_fast.cli.main import main

    assert main(["batch", "nosuch://bucket/x", "-o", str(tmp_path / "out"), "--model", str(tmp_path)]) == 2
    assert "error: cannot list nosuch://bucket/x: Unrecognized filesystem type" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_batch_without_ray_is_a_usage_error_naming_the_extra(tmp_path, monkeypatch, capsys):
    from mineru_fast.cli.main import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    text_page().save(tmp_path / "page.png")
    assert main(["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path)]) == 2
    assert "pip install 'mineru-fast[ray]'" in capsys.readouterr().err


def test_batch_takes_the_quiet_and_confidence_flags_of_parse(tiny_model, tmp_path, monkeypatch, capsys):
    """``batch`` lacked ``--quiet`` and ``--confidence`` of ``parse``: they reach the run's config,
    the actor's writer and the progress lines."""
    import json

    from mineru_fast.cli.main import main
    from mineru_fast.distributed import batch

    configs = []
    monkeypatch.setattr(batch, "run_batch", lambda config: configs.append(config) or batch.BatchSummary([], [], 0.0, 0))
    argv = ["batch", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--model", "m"]
    assert main([*argv, "--quiet", "--confidence"]) == 0 and main(argv) == 0
    assert [(c.quiet, c.confidence) for c in configs] == [(True, True), (False, False)]

    lines: list[str] = []
    progress = batch._Progress(2, lines.append, quiet=True)
    progress.document(Record("in/a.pdf", "a", "success", 1, None, 1, 1.0))
    progress.document(Record("in/b.pdf", "b", "error", 0, "CorruptDocument: x", 1, 0.0))
    assert len(lines) == 1 and lines[0].startswith("[2/2] in/b.pdf: error, 0 page(s), attempt 1: CorruptDocument: x |")

    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1)
    try:  # the driver's writer (one per document) adds the field; the actors send pages
        metadata = worker.parser.result_metadata(inspect_document("doc", pdf_bytes(1)))
        assembly = DocumentAssembly(tmp_path / "conf", "doc", [[0]], metadata, confidence=True, layout="2.x")
        assert run_task(worker, assembly, 0, pdf_bytes(1), sample_trace(1))
    finally:
        worker.parser.close()
    assert assembly.finish(wall_s=1.0) == ("success", 1)
    items = json.loads((tmp_path / "conf" / "doc" / "doc_content_list.json").read_text())
    assert len(items) == 3 and all("mf_confidence" in item for item in items)


def test_a_reparse_split_into_tasks_keeps_every_tasks_outputs_and_only_those(tiny_model, tmp_path):
    """A re-parse removes the earlier run's outputs of a document (``writer.remove_outputs``). With
    page-range tasks that happens once per document, before any task's files arrive: the task of
    pages 2-3 must not remove the files the task of page 1 brought, whatever order they finish in,
    while a stale file of the earlier run (a page the new run does not have) is gone."""
    data, trace = pdf_bytes(3), sample_trace(3)
    stale = tmp_path / "out" / "doc"
    for rel in ("images/page_7_image_0.jpg", "layout/page_0008.png", "doc.md", "doc_content_list.json"):
        (stale / rel).parent.mkdir(parents=True, exist_ok=True)
        (stale / rel).write_bytes(b"earlier run")
    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1)
    try:
        metadata = worker.parser.result_metadata(inspect_document("doc", data))
        whole = DocumentAssembly(tmp_path / "whole", "doc", [[0, 1, 2]], metadata, layout="2.x")
        assert run_task(worker, whole, 0, data, trace)
        split = DocumentAssembly(tmp_path / "out", "doc", [[0], [1, 2]], metadata, layout="2.x")
        assert [run_task(worker, split, i, data, trace) for i in (1, 0)] == [False, True]  # pages 2-3 first
    finally:
        worker.parser.close()
    assert whole.finish(wall_s=1.0) == split.finish(wall_s=1.0) == ("success", 3)
    tree = output_tree(tmp_path / "out" / "doc")
    assert sorted(tree) == [
        "doc.json", "doc.md", "doc_content_list.json",
        "images/page_0_image_2.jpg", "images/page_1_image_2.jpg", "images/page_2_image_2.jpg",
        "layout/page_0001.png", "layout/page_0002.png", "layout/page_0003.png",
    ]  # fmt: skip
    assert tree == output_tree(tmp_path / "whole" / "doc")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_batch_without_an_address_starts_its_own_local_ray_and_checks_the_model_first(
    tiny_model, tmp_path, monkeypatch
):
    """Without ``--ray-address``, a Ray found through ``RAY_ADDRESS`` (or a running ``ray start``)
    is not joined: ``ray.init`` gets ``address="local"`` (joining with ``num_cpus`` raised in Ray);
    a model directory that does not exist fails before Ray starts, with the model's own error."""
    import ray

    from mineru_fast.distributed.batch import BatchConfig, run_batch
    from mineru_fast.errors import ModelLoadError

    (tmp_path / "in").mkdir()
    text_page().save(tmp_path / "in" / "page.png")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    calls: list[dict] = []

    class Stop(Exception):
        pass

    def init(**kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ModelLoadError, match="no such model directory"):
        run_batch(BatchConfig([tmp_path / "in"], tmp_path / "out", str(tmp_path / "nosuch")), log=lambda line: None)
    assert calls == []
    with pytest.raises(Stop):
        run_batch(BatchConfig([tmp_path / "in"], tmp_path / "out", str(tiny_model)), log=lambda line: None)
    assert len(calls) == 1 and calls[0]["address"] == "local" and calls[0]["num_cpus"] >= 1


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the batch command needs Ray (the ray extra)")
def test_a_ray_address_with_no_cluster_is_one_error_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    import ray

    from mineru_fast.cli.main import main

    def no_cluster(address=None, **kwargs):  # what Ray 2.60 raises for 'auto' with none running
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by ...")

    monkeypatch.setattr(ray, "init", no_cluster)
    text_page().save(tmp_path / "page.png")
    argv = ["batch", str(tmp_path / "page.png"), "-o", str(tmp_path / "out"), "--ray-address", "auto"]
    assert main([*argv, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err == "mineru-fast: error: cannot join the Ray cluster at 'auto': Could not find any running Ray instance. "
        "Please specify the one to connect to by ...\n"
    )


def test_inspection_rows_carry_their_own_pages_not_the_document_task_list(tmp_path):
    """Every task row carried the whole document's task list and page list, so inspection memory
    grew with the square of the page count (a 347-byte PDF claiming 1M pages: ~300 GB)."""
    import pickle

    from samples import claimed_pages_pdf

    from mineru_fast.distributed.batch import ITEM, _inspect, _item, _Job, _row

    def rows(count: int, max_pages: int = 10_000) -> list[dict]:
        path = tmp_path / f"claims{count}.pdf"
        path.write_bytes(claimed_pages_pdf(count))
        job = _Job(Source(str(path), str(path)), path.stem)
        return _inspect(_row(job), None, None, None, 32, max_pages)

    small, large = rows(320), rows(3200)
    assert (len(small), len(large)) == (10, 100)
    assert max(len(row[ITEM]) for row in large) < 1500  # a row of 3200 pages' lists is over 10 KB
    tasks = [_item(row) for row in large]
    assert [task.pages for task in tasks[:2]] == ["1-32", "33-64"] and tasks[-1].pages == "3169-3200"
    assert {task.selection for task in tasks} == {"1-3200"} and tasks[0].info.pages == ()
    (refused,) = rows(1_000_000)  # over the page cap: one error row, at once
    outcome = pickle.loads(refused[ITEM])
    assert outcome.kind == "error" and outcome.error.startswith("TooManyPages: 1,000,000 pages selected")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_joining_a_cluster_passes_the_prepared_cache_switch_to_its_workers(monkeypatch):
    """``--no-prepared-cache`` sets the variable in the driver only; a cluster's workers on other
    nodes would still write 1.4 GB entries. It travels in the job's runtime environment."""
    import ray

    from mineru_fast.distributed import init_ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("MINERU_FAST_PREPARED_CACHE", "off")
    init_ray("127.0.0.1:6379")  # nothing is contacted: ray.init is the stand-in above
    monkeypatch.delenv("MINERU_FAST_PREPARED_CACHE")
    init_ray("127.0.0.1:6379")
    assert [c["runtime_env"] for c in calls] == [{"env_vars": {"MINERU_FAST_PREPARED_CACHE": "off"}}, None]


def test_task_rows_carry_a_reference_to_the_document_never_its_bytes(tmp_path):
    """Every task row of a document carried the whole document's bytes: a 6.2 MB PDF of 10,000
    pages made 313 rows of 1.9 GB. The rows name the document (its ``Source``); the actor reads it."""
    import os

    from samples import raw_pdf

    from mineru_fast.distributed.batch import ITEM, _inspect, _item, _Job, _row

    padding = os.urandom(512 * 1024).hex().encode()  # 1 MiB of an unreferenced stream: a large file
    data = raw_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 3200 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(padding), padding),
    ])  # fmt: skip
    path = tmp_path / "long.pdf"
    path.write_bytes(data)
    job = _Job(Source(str(path), str(path)), "long")
    rows = _inspect(_row(job), None, None, None, 32, 10_000)
    assert len(rows) == 100 and len(data) > 2**20
    assert sum(len(row[ITEM]) for row in rows) < 100 * 1024  # was 100 copies of the file: 100 MiB
    assert not any(padding[:64] in row[ITEM] for row in rows)
    tasks = [_item(row) for row in rows]
    assert {task.source for task in tasks} == {job.source}
    assert tasks[0].info.sha256 == hashlib.sha256(data).hexdigest()  # what the actor checks its read against


@needs_pyarrow
def test_an_actor_reads_the_document_its_task_names_and_refuses_one_changed_since_inspection(tmp_path):
    from mineru_fast.distributed.batch import _document_bytes, _inspect, _item, _Job, _row

    data = pdf_bytes(3)
    (tmp_path / "doc.pdf").write_bytes(data)
    (source,) = list_sources([(tmp_path / "doc.pdf").as_uri()])
    task = _item(_inspect(_row(_Job(source, "doc")), None, None, None, 2, 100)[1])
    assert task.pages == "3" and _document_bytes(task, ledger=None) == data  # a URI: read by the actor
    (tmp_path / "doc.pdf").write_bytes(pdf_bytes(4))  # replaced between its inspection and its parse
    with pytest.raises(SourceError, match=r"^file://.*/doc\.pdf changed since it was inspected \(its SHA-256"):
        _document_bytes(task, ledger=None)


def test_a_document_whose_tasks_ran_under_different_runtimes_records_the_mix(tmp_path):
    """An actor restarted after a failed kernel load ran per-channel INT8 while the other ran the
    block kernel: the document's metadata named the runtime of whichever task came in first. The
    mix is recorded in the outputs' metadata and the manifest, and logged even with ``quiet``."""
    from mineru_fast.distributed.batch import BatchConfig, _Job, _Outcome, _Runner
    from mineru_fast.results.metadata import PACKAGE, SCHEMA_VERSION

    block = {"isa_class": "avx512_vnni", "engine": "fast", "precision": "fp32", "int8_kernel": "onednn",
             "int8_reason": "x", "lm_int8_block": "own block-wise INT8 kernel, avx512_vnni path"}  # fmt: skip
    fallback = {**block, "lm_int8_block": "own kernels not loaded (ImportError: x): block-wise INT8 in PyTorch"}

    def done(name: str, index: int, pages: list[int], runtime: dict) -> _Outcome:
        source = {"name": name, "format": "pdf", "sha256": None, "page_count": 5, "pages": []}
        metadata = {"schema_version": SCHEMA_VERSION, "package": dict(PACKAGE), "input": source, "runtime": runtime}
        return _Outcome(name, "done", index, "1-5", metadata, [Page(i) for i in pages])

    jobs = [_Job(Source("in/mixed.pdf", "in/mixed.pdf"), "mixed"), _Job(Source("in/one.pdf", "in/one.pdf"), "one")]
    config = BatchConfig([], tmp_path, "model", pages_per_task=2, layout="2.x", quiet=True)
    lines: list[str] = []
    runner = _Runner(config, jobs, lines.append)
    for name, odd in (("mixed", fallback), ("one", block)):  # pages 3-4 come in first
        for outcome in (done(name, 1, [2, 3], odd), done(name, 2, [4], block), done(name, 0, [0, 1], block)):
            runner.take(outcome)
    assert lines == [
        "in/mixed.pdf: mixed numerics: pages 1-2,5 / 3-4 ran under different runtimes (lm_int8_block differ); "
        "recorded in its metadata.runtimes and the manifest's runtimes"
    ]
    metadata = json.loads((tmp_path / "mixed" / "mixed.json").read_text())["metadata"]
    assert metadata["runtime"] == block  # its first page's, not the first result's (pages 3-4)
    assert metadata["runtimes"] == [{"pages": [0, 1, 4], "runtime": block}, {"pages": [2, 3], "runtime": fallback}]
    records = Manifest(tmp_path).records()
    assert (records["mixed"].status, records["mixed"].pages) == ("success", 5)
    assert records["mixed"].runtimes == [{"pages": [1, 2, 5], "runtime": block}, {"pages": [3, 4], "runtime": fallback}]
    one = json.loads((tmp_path / "one" / "one.json").read_text())["metadata"]
    assert one["runtime"] == block and "runtimes" not in one and records["one"].runtimes == []
