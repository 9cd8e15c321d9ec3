"""Official lane: mineru 4.0.12's own clients parse a multi-page document through ``mineru-fast
serve``'s MinerU document API, unchanged apart from the URL: ``MinerUApiParser`` (its upload,
job and download steps, synchronous and asynchronous) and ``mineru-kit parse --remote-url``.
What they return and save is what mineru-fast produces: the Markdown of the service's own
``/v1/document/parse`` for the same replayed outputs, and the bundle ``mineru-fast parse`` writes.

The server runs in an interpreter with mineru-fast's dependencies (``test_official_bundle.fast_python``)
with a tiny synthetic model; ``serve --replay DIR`` replays the document's trace (MinerU's clients
send none), so its outputs are known.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("mineru.parser.api_client", reason="official mineru 4.0.12 not installed (official CI lane)")
httpx = pytest.importorskip("httpx")

from serve_helpers import running_server  # noqa: E402
from test_official_bundle import fast_python, run_fast, tree  # noqa: E402
from test_official_compat import SYNTHETIC  # noqa: E402

from mineru_fast.protocol.traces import Trace  # noqa: E402

NAME = "report"  # the document's stem, which names its trace in the server's --replay folder
# Images and tables on the first page, a table continued across the next pages, a running head.
PAGES = SYNTHETIC["visuals"] + SYNTHETIC["table_across_pages"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The document, its trace, a tiny model and a server replaying the trace for uploads named after it."""
    root = tmp_path_factory.mktemp("api-client")
    traces = root / "traces"
    traces.mkdir()
    trace = traces / f"{NAME}.json"
    Trace(PAGES).save(trace)
    document = root / f"{NAME}.pdf"
    images = [Image.new("RGB", (1240, 1754), "white") for _ in PAGES]
    images[0].save(document, save_all=True, append_images=images[1:], resolution=150)
    model = root / "tiny"
    assert run_fast("synth-model", "--size", "tiny", str(model)).returncode == 0
    with running_server(
        model, root, "--replay", str(traces), "--allow-replay", "--preset", "exact", python=fast_python()
    ) as server:
        yield {"url": server.url, "document": document, "trace": trace, "model": model, "root": root}


def native_markdown(served, pages: str | None = None) -> str:
    """``/v1/document/parse``'s Markdown of the document replayed with its trace."""
    files = {"file": ("any.pdf", served["document"].read_bytes()), "replay": ("t.json", served["trace"].read_bytes())}
    data = {"formats": "markdown", **({"pages": pages} if pages else {})}
    response = httpx.post(f"{served['url']}/v1/document/parse", files=files, data=data, timeout=600)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "success"
    return response.json()["markdown"]


@pytest.fixture(scope="module")
def cli_bundle(served) -> Path:
    """The bundle ``mineru-fast parse`` writes for the document replayed with its trace."""
    out = served["root"] / "cli"
    done = run_fast("parse", str(served["document"]), "-o", str(out), "--model", str(served["model"]),
                    "--replay", str(served["trace"]), "--preset", "exact", "--progress", "none")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out / NAME


def test_mineru_api_parser_returns_the_markdown_mineru_fast_gives(served):
    from mineru import MinerUApiParser

    statuses: list[str] = []
    result = MinerUApiParser(api_url=served["url"]).parse(served["document"], status_callback=statuses.append)
    markdown = result.markdown()
    assert markdown == native_markdown(served)
    assert "Fig. 1a" in markdown and "<td>" in markdown  # the replayed content, not an empty parse
    assert [page.page_idx for page in result.pages] == list(range(len(PAGES)))
    assert statuses and statuses[-1] == "completed" and set(statuses) <= {"queued", "running", "completed"}


def test_mineru_api_parser_with_images_saves_mineru_fasts_bundle(served, cli_bundle, tmp_path):
    """``include_images`` / ``include_model_output`` take the zip output; what ``ParseResult.save``
    writes from it is ``mineru-fast parse``'s bundle: the same tree, the same Markdown and pages."""
    from mineru import MinerUApiParser
    from mineru.parser.writer import FileBasedDataWriter

    parser = MinerUApiParser(api_url=served["url"], include_images=True, include_model_output=True)
    result = parser.parse(served["document"])
    saved = tmp_path / "saved"
    result.save(FileBasedDataWriter(str(saved)))
    assert tree(saved) == tree(cli_bundle) and any(name.startswith("images/") for name in tree(saved))
    assert (saved / "markdown.md").read_bytes() == (cli_bundle / "markdown.md").read_bytes()
    mine, theirs = (
        json.loads((folder / "middle_json.json").read_text(encoding="utf-8")) for folder in (saved, cli_bundle)
    )
    assert mine["pages"] == theirs["pages"]
    for image in (name for name in tree(saved) if name.startswith("images/")):
        assert (saved / image).read_bytes() == (cli_bundle / image).read_bytes()


def test_async_parse_of_the_last_pages(served):
    """``parse_async`` with MinerU's ``rN`` page range: the last two pages, as the native parse of them."""
    from mineru import MinerUApiParser

    result = asyncio.run(MinerUApiParser(api_url=served["url"]).parse_async(served["document"], page_range="r2-r1"))
    assert [page.page_idx for page in result.pages] == [len(PAGES) - 2, len(PAGES) - 1]
    assert result.markdown() == native_markdown(served, f"{len(PAGES) - 1}-{len(PAGES)}")


def test_mineru_kit_parse_with_remote_url_writes_the_bundle_zip(served, cli_bundle, tmp_path):
    """``mineru-kit parse FILE -f zip --remote-url URL``: MinerU's CLI in remote mode (it asks for
    the images, not the model output, so its zip is the bundle without ``model_output.json``)."""
    kit = Path(sys.executable).with_name("mineru-kit")
    if not kit.is_file():
        pytest.skip(f"no mineru-kit beside {sys.executable}")
    out = tmp_path / f"{NAME}.zip"
    done = subprocess.run([str(kit), "parse", str(served["document"]), "-o", str(out), "-f", "zip",
                           "--remote-url", served["url"]], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with zipfile.ZipFile(out) as archive:
        assert sorted(archive.namelist()) == [name for name in tree(cli_bundle) if name != "model_output.json"]
        assert archive.read("markdown.md") == (cli_bundle / "markdown.md").read_bytes()
