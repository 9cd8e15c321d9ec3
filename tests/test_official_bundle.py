"""Official lane: ``mineru-fast parse X -o OUT`` writes the tree mineru 4.0.12's ``ParseResult.save``
writes for the same replayed outputs, for both model versions, and official code reads
mineru-fast's bundle back.

The official side is official code only: ``MinerUParser(tier="advanced").parse`` with the replay
client of ``official_replay`` (its VLM answers come from the same trace), then ``ParseResult.save``.
mineru-fast's side is its real ``parse`` path: the CLI, in a process of an interpreter that has
mineru-fast's dependencies (``$MINERU_FAST_PYTHON``, else CI's ``.venv-ci``, else ``.venv``), with a
tiny synthetic model replaying the trace through the engine.

Differences by design (README, "Output format"): the producer (``mineru-fast``), the source's own
properties (title, dates) and ``extensions["docvortex_layout"]`` (page sizes in points) that
mineru-fast does not read, ``extensions["mineru_fast"]`` (its record), a code block's language
(official guesses it with Magika, a model; mineru-fast writes ``txt``) and ``model_output.json``'s
raw blocks (mineru-fast's analysis list, without OCR ``lines`` or inline crops).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, WORKLOAD
from PIL import Image

pytest.importorskip("mineru.parser.mineru_parser", reason="official mineru 4.0.12 not installed (official CI lane)")
pytest.importorskip("docvortex", reason="docvortex (mineru's writer) not installed (official CI lane)")

from official_replay import _CLIENT, RecordedPage, install  # noqa: E402
from test_official_compat import BY_DESIGN, SYNTHETIC, VERSIONS  # noqa: E402

from mineru_fast.protocol.traces import Trace, build_omnidocbench_traces, load_trace  # noqa: E402

# Every synthetic document of the differential lane but the ones that differ by design (README,
# "Output format"); reference_lists and table_across_pages continue across pages
# (test_continuations_are_marked_...), long_document runs past official's 64-page window.
NAMES = sorted(name for name in SYNTHETIC if f"synthetic/{name}" not in BY_DESIGN)
WORKLOAD_PAGES = 14  # every page of the demo set, as the differential lane of test_official_compat


def fast_python() -> str:
    """An interpreter with mineru-fast's dependencies (torch, transformers), or skip."""
    candidates = [os.environ.get("MINERU_FAST_PYTHON"), REPO / ".venv-ci/bin/python", REPO / ".venv/bin/python"]
    for candidate in filter(None, candidates):
        if Path(candidate).is_file():
            probe = subprocess.run([str(candidate), "-c", "import torch, transformers"], capture_output=True)
            if probe.returncode == 0:
                return str(candidate)
    pytest.skip("no interpreter with mineru-fast's dependencies ($MINERU_FAST_PYTHON, .venv-ci or .venv)")


def start_fast(*args: str, log: Path | None = None) -> subprocess.Popen:
    """mineru-fast's CLI in its own interpreter (1 thread), running while the caller goes on; its
    output goes to the file ``log`` (a full pipe would stall it), else to pipes."""
    command = [fast_python(), "-m", "mineru_fast", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)


def run_fast(*args: str) -> subprocess.CompletedProcess:
    process = start_fast(*args)
    stdout, stderr = process.communicate(timeout=1800)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def parse_all(root: Path, version: str) -> dict:
    """Inputs (the synthetic pages as PDFs, the workload page images), their traces, the official
    bundle of each and mineru-fast's ``OUT`` from one CLI run over all of them, for one model
    version (a tiny synthetic model of that version; official with image analysis on Pro-2605
    only, as mineru-fast resolves it)."""
    inputs, traces = root / "in", root / "traces"
    inputs.mkdir()
    traces.mkdir()
    for name in NAMES:
        pages = SYNTHETIC[name]
        size = (620, 877) if len(pages) > 8 else (1240, 1754)  # small pages keep the long document quick
        images = [Image.new("RGB", size, "white") for _ in pages]
        images[0].save(inputs / f"{name}.pdf", save_all=True, append_images=images[1:], resolution=size[0] / 8.27)
        Trace(pages).save(traces / f"{name}.json")
    if WORKLOAD.exists():
        build_omnidocbench_traces(WORKLOAD / "annotations.json", WORKLOAD / "images", traces)
        for image in sorted((WORKLOAD / "images").glob("*.jpg"))[:WORKLOAD_PAGES]:
            (inputs / image.name).symlink_to(image)
    model = root / "tiny"
    assert run_fast("synth-model", "--size", "tiny", "--model-version", version, str(model)).returncode == 0
    out = root / "out"
    sources = sorted(inputs.iterdir())
    # mineru-fast's parse runs in its process while official parses here: two CPU-bound sides at once.
    log = root / "parse.log"
    fast = start_fast("parse", *map(str, sources), "-o", str(out), "--model", str(model), "--replay", str(traces),
                      "--preset", "exact", "--progress", "none", log=log)  # fmt: skip
    official = root / "official"
    try:
        for source in sources:
            trace = load_trace(traces / f"{source.stem}.json")
            official_bundle(source, trace, official / source.stem, image_analysis=VERSIONS[version])
        fast.wait(timeout=1800)
    finally:
        fast.kill()  # no-op once it has ended
    assert fast.returncode == 0, log.read_text()[-4000:]
    bundles = {source.stem: (official / source.stem, out / source.stem) for source in sources}
    return {"bundles": bundles, "model": model, "inputs": inputs, "traces": traces}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(version)``: ``parse_all`` for that version, made once per module."""
    made: dict[str, dict] = {}

    def run(version: str) -> dict:
        if version not in made:
            made[version] = parse_all(tmp_path_factory.mktemp(f"bundle-{version}"), version)
        return made[version]

    return run


@pytest.fixture(scope="module")
def parsed(runs):
    return runs("pro-2605")


def official_bundle(document: Path, trace: Trace, dest: Path, *, image_analysis: bool) -> None:
    """Official mineru 4.0.12 parses ``document`` with the trace's answers and saves its bundle."""
    from mineru.parser.mineru_parser import MinerUParser
    from mineru.parser.writer import FileBasedDataWriter

    install()
    _CLIENT.reset([RecordedPage(page.layout, list(page.contents)) for page in trace.pages])
    MinerUParser(tier="advanced", image_analysis=image_analysis).parse(document).save(FileBasedDataWriter(str(dest)))


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def without_code_language(value):
    """The documented difference: official guesses a code block's language (Magika), mineru-fast
    writes ``txt``; compared without it."""
    if isinstance(value, dict):
        return {k: without_code_language(v) for k, v in value.items() if k != "guess_lang"}
    if isinstance(value, list):
        return [without_code_language(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"^(`{3,})[A-Za-z0-9_.+#-]*$", r"\1", value, flags=re.MULTILINE)
    return value


def documents() -> list[str]:
    workload = sorted(p.stem for p in (WORKLOAD / "images").glob("*.jpg")) if WORKLOAD.exists() else []
    return NAMES + workload[:WORKLOAD_PAGES]


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("name", documents())
def test_cli_writes_the_tree_mineru_4_writes(runs, name, version):
    official, fast = runs(version)["bundles"][name]
    assert tree(fast) == tree(official)  # markdown.md, middle_json.json, ..., images/<same names>
    fast_md, official_md = (fast / "markdown.md").read_bytes(), (official / "markdown.md").read_bytes()
    assert without_code_language(fast_md.decode()) == without_code_language(official_md.decode())
    for file in ("middle_json.json", "structured_content.json"):
        mine, theirs = (json.loads((folder / file).read_text(encoding="utf-8")) for folder in (fast, official))
        assert without_code_language(mine["pages"]) == without_code_language(theirs["pages"]), file
        assert mine["is_full_document"] == theirs["is_full_document"]
        assert mine["extensions"]["mineru"] == theirs["extensions"]["mineru"]
        assert mine["metadata"]["document"].get("page_count") == theirs["metadata"]["document"].get("page_count")
    middle = json.loads((fast / "middle_json.json").read_text(encoding="utf-8"))
    assert middle["schema"] == "docvortex.middle" and middle["metadata"]["producer"]["name"] == "mineru-fast"
    assert middle["extensions"]["mineru_fast"]["status"] == "success"


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("name", documents())
def test_official_code_reads_mineru_fasts_bundle(runs, name, version):
    """``ParseResult.from_json(middle_json.json).markdown()`` is mineru-fast's ``markdown.md``; the
    middle JSON and ``model_output.json`` validate against DocVortex's schema."""
    from docvortex.schema import MiddleJson, ModelJson
    from mineru.parser.base import ParseResult

    _, fast = runs(version)["bundles"][name]
    text = (fast / "middle_json.json").read_text(encoding="utf-8")
    assert ParseResult.from_json(text).markdown() == (fast / "markdown.md").read_bytes().decode("utf-8")
    MiddleJson.from_dict(json.loads(text))
    model = ModelJson.from_dict(json.loads((fast / "model_output.json").read_text(encoding="utf-8")))
    assert len(model.pages) == len(json.loads(text)["pages"])
    assert text == json.dumps(json.loads(text), ensure_ascii=False, indent=2)  # written as official writes it


def continuations(middle: dict) -> list[tuple[int, int, list[str]]]:
    """``(page_idx, block position, the block's keys in order)`` of each block marked ``continues_prev``."""
    return [
        (page["page_idx"], position, list(block))
        for page in middle["pages"]
        for position, block in enumerate(page["blocks"])
        if block.get("continues_prev") is True
    ]


@pytest.mark.parametrize(
    ("name", "marked", "joined"),
    [
        # the second and third reference lists of page 0 continue the first; page 1's (after its
        # running head) continues them across the page break
        ("reference_lists", [(0, 2), (0, 3), (1, 1)], ["[4] D. Four. 2023.\n[5] E. Five. 2024.\n[6] F. Six. 2025."]),
        # page 1's first table continues page 0's; page 2's (other columns) does not continue page 1's
        # last; page 3's (a running head before it) continues page 2's, its cells lined up by spans
        (
            "table_across_pages",
            [(1, 0), (3, 1)],
            ["| b | 2 |\n| c | 3 |", '<td colspan="2">1</td><td>3</td></tr><tr><td colspan="2">4</td>'],
        ),
    ],
)
def test_continuations_are_marked_as_official_marks_them(parsed, name, marked, joined):
    """mineru-fast's middle JSON marks ``continues_prev`` on the blocks official's marks, the field
    placed where official places it, so official's renderer reading it back joins what
    ``markdown.md`` joins."""
    from mineru.parser.base import ParseResult

    official, fast = parsed["bundles"][name]
    text = (fast / "middle_json.json").read_text(encoding="utf-8")
    mine, theirs = json.loads(text), json.loads((official / "middle_json.json").read_text(encoding="utf-8"))
    assert continuations(mine) == continuations(theirs)
    assert [(page, position) for page, position, _ in continuations(mine)] == marked
    markdown = (fast / "markdown.md").read_bytes().decode("utf-8")
    assert all(part in markdown for part in joined)
    assert ParseResult.from_json(text).markdown() == markdown


def test_docvortex_renders_every_target_from_mineru_fasts_bundle(parsed, tmp_path):
    from mineru_fast.results.official import TARGETS, render

    _, fast = parsed["bundles"]["visuals"]
    outputs = {target: render(fast, target) for target in TARGETS}
    assert outputs["markdown"] == (fast / "markdown.md").read_bytes().decode("utf-8")
    assert outputs["structured_content"] == json.loads((fast / "structured_content.json").read_text(encoding="utf-8"))
    assert "<table" in outputs["html"] and "Fig. 1a" in outputs["html"]
    assert "\\begin{document}" in outputs["latex"]
    assert outputs["docx"][:2] == b"PK" and outputs["epub"][:2] == b"PK" and outputs["pdf"][:5] == b"%PDF-"


def test_cli_formats_shaped_like_mineru_f(parsed, tmp_path):
    """``-f zip`` writes ``OUT/<stem>.zip`` holding the bundle, ``-f markdown`` ``OUT/<stem>.md``,
    ``-f html`` the bundle and ``OUT/<stem>/<stem>.html`` rendered by DocVortex where mineru-fast's
    environment has it (the mineru4 extra), else it refuses before parsing and names the extra."""
    import zipfile

    official, fast = parsed["bundles"]["two_pages"]
    source, trace = parsed["inputs"] / "two_pages.pdf", parsed["traces"] / "two_pages.json"
    common = [str(source), "--model", str(parsed["model"]), "--replay", str(trace), "--preset", "exact"]
    renders = subprocess.run([fast_python(), "-c", "import docvortex"], capture_output=True).returncode == 0
    for fmt in ("zip", "markdown", "html"):
        done = run_fast("parse", *common, "--progress", "none", "-o", str(tmp_path / fmt), "-f", fmt)
        if fmt == "html" and not renders:  # mineru-fast's environment has no mineru4 extra: a typed refusal
            assert done.returncode == 2 and "pip install 'mineru-fast[mineru4]'" in done.stderr
            continue
        assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(tmp_path / "zip" / "two_pages.zip") as archive:
        assert sorted(archive.namelist()) == tree(official)
    assert sorted(p.name for p in (tmp_path / "zip").iterdir()) == ["two_pages.zip"]
    assert (tmp_path / "markdown" / "two_pages.md").read_bytes() == (fast / "markdown.md").read_bytes()
    assert sorted(p.name for p in (tmp_path / "markdown").iterdir()) == ["two_pages.md"]
    if renders:
        assert "Page two." in (tmp_path / "html" / "two_pages" / "two_pages.html").read_text(encoding="utf-8")
