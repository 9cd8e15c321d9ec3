"""Official lane: ``mineru-fast parse X -o OUT`` writes the tree mineru 4.0.12's ``ParseResult.save``
writes for the same replayed outputs, for both model versions, and official code reads
mineru-fast's bundle back.

The official side is official code only: ``MinerUParser(tier="advanced").parse`` with the replay
client of ``official_replay`` (its VLM answers come from the same trace), then ``ParseResult.save``.
mineru-fast's side is its real ``parse`` path: the CLI, in a process of an interpreter that has
mineru-fast's dependencies (``$MINERU_FAST_PYTHON``, else CI's ``.venv-ci``, else ``.venv``), with a
tiny synthetic model replaying the trace through the engine.

Whole files are compared: ``middle_json.json`` and ``structured_content.json`` entire (the source's
declared properties in ``metadata.document``, its page geometry and rotated crops in
``extensions["docvortex_layout"]``, every page), ``model_output.json``'s document fields, and what
DocVortex renders from the bundle. Differences by design (README, "Output format";
``BY_DESIGN_FIELDS``): the producer (``mineru-fast``), ``extensions["mineru_fast"]`` (its record),
a code block's language (official guesses it with Magika, a model; mineru-fast writes ``txt``),
``model_output.json``'s raw blocks (mineru-fast's analysis list, without OCR ``lines`` or inline
crops) and the crops' JPEG bytes (each engine cuts and encodes its own; the same regions and names).
"""

from __future__ import annotations

import copy
import functools
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


# Documents whose PDF declares properties (``declare``): official's metadata.document and the
# geometry of a page turned by /Rotate come from the source, not the model.
DECLARING = {"rotated_visuals"}
XMP = """<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>
<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">
<rdf:Description rdf:about="" xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:xmp="http://ns.adobe.com/xap/1.0/"
 xmp:ModifyDate="2024-03-05T10:00:00" xmp:CreateDate="1999-01-01">
<dc:title><rdf:Alt><rdf:li xml:lang="x-default">Not used: the dictionary has a title</rdf:li></rdf:Alt></dc:title>
<dc:description><rdf:Alt><rdf:li xml:lang="en">Read from XMP</rdf:li></rdf:Alt></dc:description>
<dc:publisher><rdf:Bag><rdf:li>A Publisher</rdf:li></rdf:Bag></dc:publisher>
<dc:identifier>doi:10.1000/xyz</dc:identifier>
</rdf:Description></rdf:RDF></x:xmpmeta>
<?xpacket end="w"?>"""


def declare(path: Path) -> None:
    """Give the PDF at ``path`` an information dictionary (a zoned creation date, no
    modification date), a catalog language, an XMP packet (its description, publisher,
    identifier and modification date fill what the dictionary lacks) and turn its last page by
    90 degrees (/Rotate)."""
    from pypdf import PdfWriter
    from pypdf.generic import NameObject, StreamObject, TextStringObject

    writer = PdfWriter(clone_from=path)
    writer.metadata = {  # replaces the dictionary Pillow wrote (its dates are the time of saving)
        "/Title": "  A declared title\x00 ", "/Author": "Ann; Bob", "/Subject": "Subjects", "/Keywords": "k1, k2",
        "/CreationDate": "D:20240102030405+01'00'", "/Creator": "A writer", "/Producer": "pypdf",
    }  # fmt: skip
    writer.pages[-1].rotate(90)
    packet = StreamObject()
    packet.set_data(XMP.encode("utf-8"))
    packet.update({NameObject("/Type"): NameObject("/Metadata"), NameObject("/Subtype"): NameObject("/XML")})
    writer._root_object[NameObject("/Metadata")] = writer._add_object(packet)
    writer._root_object[NameObject("/Lang")] = TextStringObject("de-DE")
    writer.write(path)


def parse_all(roots: dict[str, Path]) -> dict[str, dict]:
    """For each model version (its folder in ``roots``): inputs (the synthetic pages as PDFs, the
    workload page images), their traces, the official bundle of each and mineru-fast's ``OUT``
    from one CLI run over all of them (a tiny synthetic model of that version; official with
    image analysis on Pro-2605 only, as mineru-fast resolves it).

    mineru-fast's parses of every version run in their processes (1 thread each) while official
    parses here, one document after another: the machine's cores stay busy until the last side ends.
    """
    started = {}
    for version, root in roots.items():
        inputs, traces = root / "in", root / "traces"
        inputs.mkdir()
        traces.mkdir()
        for name in NAMES:
            pages = SYNTHETIC[name]
            size = (620, 877) if len(pages) > 8 else (1240, 1754)  # small pages keep the long document quick
            images = [Image.new("RGB", size, "white") for _ in pages]
            images[0].save(inputs / f"{name}.pdf", save_all=True, append_images=images[1:], resolution=size[0] / 8.27)
            if name in DECLARING:
                declare(inputs / f"{name}.pdf")
            Trace(pages).save(traces / f"{name}.json")
        if WORKLOAD.exists():
            build_omnidocbench_traces(WORKLOAD / "annotations.json", WORKLOAD / "images", traces)
            for image in sorted((WORKLOAD / "images").glob("*.jpg"))[:WORKLOAD_PAGES]:
                (inputs / image.name).symlink_to(image)
        model = root / "tiny"
        assert run_fast("synth-model", "--size", "tiny", "--model-version", version, str(model)).returncode == 0
        sources = sorted(inputs.iterdir())
        log = root / "parse.log"
        fast = start_fast("parse", *map(str, sources), "-o", str(root / "out"), "--model", str(model), "--replay",
                          str(traces), "--preset", "exact", "--progress", "none", log=log)  # fmt: skip
        started[version] = (fast, log, sources, model)
    made = {}
    try:
        for version, root in roots.items():
            sources = started[version][2]
            for source in sources:
                trace = load_trace(root / "traces" / f"{source.stem}.json")
                official_bundle(source, trace, root / "official" / source.stem, image_analysis=VERSIONS[version])
        for version, root in roots.items():
            fast, log, sources, model = started[version]
            fast.wait(timeout=1800)
            assert fast.returncode == 0, log.read_text()[-4000:]
            bundles = {source.stem: (root / "official" / source.stem, root / "out" / source.stem) for source in sources}
            made[version] = {"bundles": bundles, "model": model, "inputs": root / "in", "traces": root / "traces"}
    finally:
        for fast, *_ in started.values():
            fast.kill()  # no-op once it has ended
    return made


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(version)``: ``parse_all``'s result for that version; every version is made at the
    first call, once per module."""
    made: dict[str, dict] = {}

    def run(version: str) -> dict:
        if not made:
            made.update(parse_all({v: tmp_path_factory.mktemp(f"bundle-{v}") for v in sorted(VERSIONS)}))
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


# The fields of the whole files that differ by design (README, "Output format"): the producer
# (mineru-fast) and mineru-fast's own record (its extension). A code block's language is the
# third difference (without_code_language).
BY_DESIGN_FIELDS = (("metadata", "producer"), ("extensions", "mineru_fast"))


def whole(document: dict) -> str:
    """A result file as text (keys in their order) without ``BY_DESIGN_FIELDS`` or a code
    block's language: what must equal official's file."""
    document = copy.deepcopy(document)
    for parent, key in BY_DESIGN_FIELDS:
        document[parent].pop(key, None)
    return json.dumps(without_code_language(document), ensure_ascii=False, indent=2)


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("name", documents())
def test_cli_writes_the_tree_mineru_4_writes(runs, name, version):
    """The same files, and the same whole middle JSON and structured content (every document
    field: properties, page geometry and image rotations, tier, is_full_document; every page)
    but the fields named in ``BY_DESIGN_FIELDS``; ``model_output.json``'s document fields too
    (its pages are mineru-fast's analysis list, by design)."""
    official, fast = runs(version)["bundles"][name]
    assert tree(fast) == tree(official)  # markdown.md, middle_json.json, ..., images/<same names>
    fast_md, official_md = (fast / "markdown.md").read_bytes(), (official / "markdown.md").read_bytes()
    assert without_code_language(fast_md.decode()) == without_code_language(official_md.decode())
    for file in ("middle_json.json", "structured_content.json", "model_output.json"):
        mine, theirs = (json.loads((folder / file).read_text(encoding="utf-8")) for folder in (fast, official))
        assert mine["metadata"]["producer"]["name"] == "mineru-fast" and "mineru_fast" not in theirs["extensions"]
        if file == "model_output.json":
            mine, theirs = ({k: v for k, v in d.items() if k != "pages"} for d in (mine, theirs))
        assert whole(mine) == whole(theirs), file
    middle = json.loads((fast / "middle_json.json").read_text(encoding="utf-8"))
    assert middle["extensions"]["mineru_fast"]["status"] == "success"
    assert [p["page_idx"] for p in middle["extensions"]["docvortex_layout"]["pages"]] == [
        p["page_idx"] for p in middle["pages"]
    ]


def test_declared_properties_and_rotations_are_official_values(runs):
    """The document with declared properties and rotated crops holds what its source and trace
    say (so the whole-file comparison above compares something): Info first, XMP for the rest,
    dates as declared, the turned page's size swapped, each rotated crop by its index."""
    official, fast = runs("pro-2605")["bundles"]["rotated_visuals"]
    middle = json.loads((fast / "middle_json.json").read_text(encoding="utf-8"))
    assert middle["metadata"]["document"] == {
        "title": "A declared title", "authors": ["Ann; Bob"], "subject": "Subjects", "keywords": ["k1, k2"],
        "description": "Read from XMP", "languages": ["de-DE"], "identifiers": ["doi:10.1000/xyz"],
        "publisher": "A Publisher", "created_at": "2024-01-02T03:04:05+01:00", "modified_at": "2024-03-05T10:00:00",
        "creator_application": "A writer", "producer_application": "pypdf", "page_count": 2,
        "page_count_kind": "physical",
    }  # fmt: skip
    first, turned = middle["extensions"]["docvortex_layout"]["pages"]
    assert (first["width_pt"], first["height_pt"]) == (turned["height_pt"], turned["width_pt"])
    assert first["image_rotations"] == {"1": 90, "4": 270, "5": 180} and turned["image_rotations"] == {"0": 90}


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


def comparable(target: str, output: str | bytes | dict) -> object:
    """A DocVortex rendering as it is compared: text and PDF as they are (the same bytes),
    structured content as ``whole`` files, a DOCX or EPUB as its members' names and bytes (the
    archive's own timestamps are the time of rendering), with two lines of an EPUB's package left
    out: ``dcterms:modified`` (that time) and the ``dc:identifier`` (a name-based UUID of the whole
    middle JSON, whose producer differs by design)."""
    import io
    import zipfile

    if isinstance(output, dict):
        return whole(output)
    if target not in ("docx", "epub"):
        return output
    assert isinstance(output, bytes)
    with zipfile.ZipFile(io.BytesIO(output)) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    stamped = (
        rb'<meta property="dcterms:modified">[^<]*</meta>|<dc:identifier id="pub-id">urn:uuid:[^<]*</dc:identifier>'  # noqa: E501
    )
    return {name: re.sub(stamped, b"", data) if name.endswith(".opf") else data for name, data in members.items()}


def asset_of(bundle: Path, path: str) -> bytes:
    """A bundle's file ``path`` (an image its middle JSON names), for DocVortex's asset resolver."""
    return (bundle / path).read_bytes()


def render_with_crops(bundle: Path, crops: Path, target: str) -> str | bytes | dict:
    """DocVortex's rendering of ``bundle``'s middle JSON to ``target``, its images read from the
    bundle ``crops`` (the same file names)."""
    from docvortex.render import DocxRenderOptions, EpubRenderOptions, PdfRenderOptions, RenderFormat
    from docvortex.render import render as docvortex_render

    from mineru_fast.results.official import load_middle_json

    options = {"docx": DocxRenderOptions, "epub": EpubRenderOptions, "pdf": PdfRenderOptions}
    option = options[target](asset_resolver=functools.partial(asset_of, crops)) if target in options else None
    return docvortex_render(load_middle_json(bundle / "middle_json.json"), RenderFormat(target), options=option)


# A PDF with declared properties, a turned page and rotated crops; one with visuals and
# captions; an empty page between two; a page image (an image is a page at 200 dpi).
RENDERED = ["rotated_visuals", "visuals", "unicode_and_empty_page"]


@pytest.mark.parametrize("name", RENDERED + ["workload"])
def test_docvortex_renders_mineru_fasts_bundle_as_officials(parsed, name):
    """Every target DocVortex renders from mineru-fast's middle JSON equals its rendering of
    official's for the same pages (``comparable``), both with official's crops: each engine cuts
    and encodes its own crops of the same regions (the same names, other JPEG bytes), and what
    is compared here is what the middle JSON makes of them. The PDF is in the source's page
    layout: it needs extensions.docvortex_layout (a bundle without it gets a reflowed PDF)."""
    from docvortex.render import PdfLayout, PdfRenderOptions, RenderFormat
    from docvortex.render import render as docvortex_render

    from mineru_fast.results.official import TARGETS, load_middle_json

    if name == "workload":
        name = next((n for n in documents() if n not in NAMES), None) or pytest.skip("no workload pages here")
    official, fast = parsed["bundles"][name]
    for target in TARGETS:
        mine, theirs = (render_with_crops(bundle, official, target) for bundle in (fast, official))
        assert comparable(target, mine) == comparable(target, theirs), target
    original = PdfRenderOptions(asset_resolver=functools.partial(asset_of, official), layout=PdfLayout.ORIGINAL)
    middle = load_middle_json(fast / "middle_json.json")
    assert docvortex_render(middle, RenderFormat.PDF, options=original) == render_with_crops(fast, official, "pdf")


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


def test_cli_pdf_is_officials_original_layout(parsed, tmp_path):
    """``-f pdf`` on a PDF (declared properties, a turned page, rotated crops) and on a page
    image writes the PDF in the source's page layout (DocVortex's original layout, byte for byte),
    not the reflowed fallback a bundle without extensions.docvortex_layout gets; that it equals
    official's rendering is the test above."""
    from docvortex.render import PdfLayout, PdfRenderOptions, RenderFormat
    from docvortex.render import render as docvortex_render

    from mineru_fast.results.official import load_middle_json

    if subprocess.run([fast_python(), "-c", "import docvortex"], capture_output=True).returncode != 0:
        pytest.skip("mineru-fast's environment has no DocVortex (the mineru4 extra): -f pdf refuses (test above)")
    image = next((n for n in documents() if n not in NAMES), None)
    for name in ["rotated_visuals"] + ([image] if image else []):
        source = next(parsed["inputs"].glob(f"{name}.*"))
        common = [str(source), "--model", str(parsed["model"]), "--replay", str(parsed["traces"] / f"{name}.json")]
        done = run_fast("parse", *common, "--preset", "exact", "--progress", "none", "-o", str(tmp_path), "-f", "pdf")
        assert done.returncode == 0, done.stderr
        assert "reflow" not in done.stderr
        bundle = tmp_path / name
        original = PdfRenderOptions(asset_resolver=functools.partial(asset_of, bundle), layout=PdfLayout.ORIGINAL)
        middle = load_middle_json(bundle / "middle_json.json")
        assert (bundle / f"{name}.pdf").read_bytes() == docvortex_render(middle, RenderFormat.PDF, options=original)
