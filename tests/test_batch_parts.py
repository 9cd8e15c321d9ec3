"""The parts of ``mineru-fast batch`` that need no Ray: the actor body, the manifest, the job plan."""

from __future__ import annotations

import pytest
from samples import pdf_bytes, sample_trace, text_page

from mineru_fast.distributed.batch import BatchError, plan_jobs
from mineru_fast.distributed.manifest import Manifest, Record
from mineru_fast.distributed.worker import DocumentWorker
from mineru_fast.options import ParserOptions


def test_the_worker_streams_a_documents_files_page_by_page(tiny_model, tmp_path):
    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1)
    try:
        events = list(worker.parse("doc", pdf_bytes(2), trace=sample_trace(2)))
        broken = list(worker.parse("bad", b"%PDF-1.7 cut short"))
    finally:
        worker.parser.close()
    assert [(e["kind"], e.get("index"), e.get("status")) for e in events] == [
        ("page", 0, "success"), ("page", 1, "success"), ("done", None, "success")
    ]  # fmt: skip
    per_page = [sorted(e["files"]) for e in events[:2]]
    assert per_page == [
        ["images/page_0_image_2.jpg", "layout/page_0001.png"],
        ["images/page_1_image_2.jpg", "layout/page_0002.png"],
    ]
    assert sorted(events[2]["files"]) == ["doc.json", "doc.md", "doc_content_list.json"]
    assert events[2]["pages"] == 2 and b"A replayed title" in events[2]["files"]["doc.md"]
    assert [e["kind"] for e in broken] == ["error"] and broken[0]["error"].startswith("CorruptDocument: ")
    assert worker.describe()["threads"] == 1


def test_the_manifest_keeps_each_documents_last_record_and_checks_outputs(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.append(Record("in/a.pdf", "a", "error", 0, "ActorDiedError: killed", 3, 9.0))
    manifest.append(Record("in/a.pdf", "a", "success", 2, None, 1, 4.0))
    manifest.append(Record("in/b.pdf", "b", "partial", 1, None, 1, 2.0))
    manifest.append(Record("in/c.pdf", "c", "error", 0, "CorruptDocument: x", 1, 0.0))
    with manifest.path.open("a") as out:
        out.write('{"document": "in/d.pdf", "na')  # a line cut by a crash
    assert manifest.records()["a"].status == "success" and len(manifest.records()) == 3
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "a.json").write_text("{}")
    assert manifest.complete() == {"a"}  # b has no outputs on disk, c never parsed


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


def test_batch_without_ray_is_a_usage_error_naming_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from mineru_fast.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    text_page().save(tmp_path / "page.png")
    assert main(["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path)]) == 2
    assert "pip install 'mineru-fast[ray]'" in capsys.readouterr().err


def test_batch_takes_the_quiet_and_confidence_flags_of_parse(tiny_model, tmp_path, monkeypatch, capsys):
    """``batch`` lacked ``--quiet`` and ``--confidence`` of ``parse``: they reach the run's config,
    the actor's writer and the progress lines."""
    import json

    from mineru_fast.cli import main
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
    try:
        *_, done = worker.parse("doc", pdf_bytes(1), trace=sample_trace(1), confidence=True)
    finally:
        worker.parser.close()
    items = json.loads(done["files"]["doc_content_list.json"])
    assert len(items) == 3 and all("mf_confidence" in item for item in items)
