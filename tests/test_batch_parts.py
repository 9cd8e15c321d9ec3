"""The parts of ``mineru-fast batch`` that need no Ray: the actor body, the manifest, the job plan,
the input listing (local paths and ``file://`` URIs through pyarrow)."""

from __future__ import annotations

import pytest
from samples import pdf_bytes, sample_trace, text_page

from mineru_fast.distributed.batch import BatchError, plan_jobs
from mineru_fast.distributed.manifest import Manifest, Record
from mineru_fast.distributed.sources import Source, list_sources
from mineru_fast.distributed.worker import DocumentWorker
from mineru_fast.errors import SourceError
from mineru_fast.options import ParserOptions


def test_the_worker_streams_a_documents_files_page_by_page(tiny_model, tmp_path):
    worker = DocumentWorker(str(tiny_model), ParserOptions.preset("fast"), threads=1)
    try:
        events = list(worker.parse("doc", pdf_bytes(2), trace=sample_trace(2)))
        broken = list(worker.parse("bad", b"%PDF-1.7 cut short"))
        (tmp_path / "doc.pdf").write_bytes(pdf_bytes(2))
        (uri_source,) = list_sources([(tmp_path / "doc.pdf").as_uri()])
        from_uri = list(worker.parse("doc", uri_source, trace=sample_trace(2)))  # the actor reads the file
        missing = list(worker.parse("gone", Source("file:///gone.pdf", "/gone.pdf", uri_source.filesystem)))
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
    assert [e["files"] for e in from_uri[:2]] == [e["files"] for e in events[:2]]  # the same pages, as bytes
    assert [e["kind"] for e in missing] == ["error"] and missing[0]["error"].startswith("SourceError: cannot read")
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


def test_batch_without_ray_is_a_usage_error_naming_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from mineru_fast.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    text_page().save(tmp_path / "page.png")
    assert main(["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path)]) == 2
    assert "pip install 'mineru-fast[ray]'" in capsys.readouterr().err
