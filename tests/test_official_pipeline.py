"""Official lane: mineru 4.0.12's own pipeline with ``model.vlm.server_url`` set to a real
``mineru-fast serve`` (its ``http-client``, MinerU's default concurrency of 100 and timeout of
600 s) parses a 22-page PDF and an image as it does with the same raw outputs replayed in process.

First official code runs with the replay client of ``official_replay`` (its VLM answers come from
synthetic traces); every request it makes is recorded (the PNG bytes mineru-vl-utils would send for
the image, the prompt, the answer). Then a server on the tiny synthetic model replays those answers
(``serve --chat-replay``: each answer forced through the engine, every forward pass computed), and
the same official pipeline, its small local models stubbed as ``official_replay`` stubs them, runs
against it over HTTP. Its outputs equal the replayed run's, and the server's ``/metrics`` count every
request answered ``200``, no ``429``, one generation per distinct request and no twin joined.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("mineru.parser.mineru_parser", reason="official mineru 4.0.12 not installed (official CI lane)")
pytest.importorskip("docvortex", reason="docvortex (mineru's writer) not installed (official CI lane)")

from official_replay import _CLIENT, RecordedPage, official_outputs  # noqa: E402
from serve_helpers import running_server  # noqa: E402
from test_official_bundle import fast_python, run_fast  # noqa: E402
from test_official_compat import SYNTHETIC, long_document  # noqa: E402

PDF_NAMES = ["all_types", "visuals", "two_pages", "equations_rotation_nontext", "image_block", "fullwidth_tables",
             "reference_lists", "table_across_pages", "more_rules", "image_analysis"]  # fmt: skip


def pages_of_pdf():
    """22 pages: every synthetic document of the differential lane, then plain text pages."""
    pages = [page for name in PDF_NAMES for page in SYNTHETIC[name]]
    return pages + long_document(22 - len(pages))


def noise_page(seed: int, size: tuple[int, int]) -> Image.Image:
    """A page of light noise: every page, and so every crop, has pixels of its own (blank pages
    would make equal crops of different blocks, which a server rightly answers as twins)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(200, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """``{name: (path, traces)}``: the PDF and the image."""
    root = tmp_path_factory.mktemp("pipeline_docs")
    pdf_pages = pages_of_pdf()
    assert len(pdf_pages) >= 20
    images = [noise_page(n, (620, 877)) for n in range(len(pdf_pages))]
    pdf = root / "long.pdf"
    images[0].save(pdf, save_all=True, append_images=images[1:], resolution=620 / 8.27)
    png = root / "page.png"
    noise_page(100, (1240, 1754)).save(png)
    return {"long": (pdf, pdf_pages), "page": (png, SYNTHETIC["visuals"])}


def request_key(image, prompt: str) -> tuple[str, str]:
    """What the server matches a recorded answer by: the SHA-256 of the PNG mineru-vl-utils' client
    sends for ``image`` (its own encoder), and the prompt."""
    from mineru_vl_utils.vlm_client.utils import image_to_bytes_list_and_format

    data, _ = image_to_bytes_list_and_format(image)
    return hashlib.sha256(data[0]).hexdigest(), prompt


def official_bytes(result) -> tuple[bytes, bytes]:
    """``(markdown.md, content list JSON)`` of an official ``ParseResult``, as ``official_outputs``
    serializes them."""
    from docvortex.export import materialize_middle
    from mineru.parser.writer import FileBasedDataWriter
    from mineru.render.content_list import render_content_list

    with tempfile.TemporaryDirectory() as tmp:
        result.save(FileBasedDataWriter(tmp))
        markdown = Path(tmp, "markdown.md").read_bytes()
    middle, _ = materialize_middle(result.middle_json)
    return markdown, json.dumps(render_content_list(middle), ensure_ascii=False, indent=2).encode("utf-8")


@pytest.fixture(scope="module")
def replayed(documents):
    """Official outputs with the in-process replay client, and the requests it answered."""
    answers: dict[tuple[str, str], str] = {}
    calls: list[tuple[str, str]] = []
    original = type(_CLIENT).batch_predict

    def recording(images, prompts, params=None, priority=None, **kwargs):
        outputs = original(_CLIENT, images, prompts, params, priority, **kwargs)
        prompts = [prompts] * len(images) if isinstance(prompts, str) else list(prompts)
        for image, prompt, output in zip(images, prompts, outputs, strict=True):
            key = request_key(image, prompt)
            assert answers.setdefault(key, output) == output, "two requests alike with different answers"
            calls.append(key)
        return outputs

    _CLIENT.batch_predict = recording  # the instance's method, for this module's runs
    try:
        outputs = {
            name: official_outputs(path, [RecordedPage(p.layout, list(p.contents)) for p in pages], image_analysis=True)
            for name, (path, pages) in documents.items()
        }
    finally:
        del _CLIENT.batch_predict
    return outputs, answers, calls


@pytest.fixture(scope="module")
def server(replayed, tmp_path_factory):
    _, answers, _ = replayed
    root = tmp_path_factory.mktemp("pipeline_server")
    entries = [{"image_sha256": sha, "prompt": prompt, "output": out} for (sha, prompt), out in answers.items()]
    (root / "answers.json").write_text(json.dumps({"answers": entries}), encoding="utf-8")
    model = root / "tiny"
    assert run_fast("synth-model", "--size", "tiny", str(model)).returncode == 0
    # Replayed answers are at most a few hundred tokens; the bound keeps prompt + bound in a slot.
    args = [
        "--chat-replay",
        str(root / "answers.json"),
        "--max-new-tokens",
        "layout=1024,text=256,table=256,equation=256",
        "--preset",
        "exact",
    ]
    with running_server(model, root, *args, python=fast_python(), ready_timeout=600) as s:
        yield s


def metric_samples(url: str) -> dict[str, float]:
    """The server's metric samples, keyed ``name{label="v",...}`` (labels sorted), read from
    Prometheus' text format (this environment has no prometheus-client)."""
    import re

    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        pairs = sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        key = ",".join(f'{k}="{v}"' for k, v in pairs)
        out[f"{name}{{{key}}}" if key else name] = float(value)
    return out


def test_mineru_4_pipeline_against_mineru_fast_serve_gives_the_replayed_outputs(
    documents, replayed, server, monkeypatch
):
    import mineru.backend.analysis.pdf.pipeline as pipeline
    import mineru_vl_utils.mineru_client as client_module
    from mineru.config import VlmConfig
    from mineru.model.vlm.client import get_vlm_predictor
    from mineru.parser.mineru_parser import MinerUParser
    from mineru_vl_utils.vlm_client import new_vlm_client

    outputs, _, calls = replayed
    # The replay install routes the VLM to the in-process client: here the real one, to the server;
    # the weight-bound local models (layout, OCR detection) stay stubbed.
    monkeypatch.setattr(pipeline, "get_vlm_predictor", get_vlm_predictor)
    monkeypatch.setattr(client_module, "new_vlm_client", new_vlm_client)
    settings = VlmConfig(server_url=server.url)
    assert (settings.max_concurrency, settings.http_timeout) == (100, 600)  # MinerU's defaults, as used
    for name, (path, pages) in documents.items():
        result = MinerUParser(tier="advanced", image_analysis=True, vlm_config=settings).parse(path)
        assert len(result.middle_json.pages) == len(pages)
        markdown, content_list = official_bytes(result)
        assert (markdown, content_list) == outputs[name], name
        page_numbers = {item["page_idx"] for item in json.loads(content_list)}
        assert page_numbers == set(range(len(pages))), name  # every page has its blocks
    samples = metric_samples(server.url)
    chat = '{method="POST",route="/v1/chat/completions",status="%s"}'
    assert samples.get("mineru_fast_requests_total" + chat % "200") == len(calls)
    assert not any(k.startswith("mineru_fast_requests_total") and 'status="429"' in k for k in samples)
    assert samples['mineru_fast_chat_requests_total{status="200"}'] == len(calls)
    assert len(set(calls)) == len(calls)  # every request of the document is a distinct one
    assert samples["mineru_fast_chat_generations_started_total"] == len(calls)  # none decoded twice
    assert samples.get("mineru_fast_chat_twin_joins_total", 0) == 0
