"""Replay the same raw model outputs through official MinerU 4.0.12 and through mineru-fast.

Official path: ``MinerUParser(tier="advanced", image_analysis=...).parse`` -> ``doc_analyze``
(effort ``xhigh``, windows of 64 pages) -> ``MinerUClient.batch_two_step_extract`` whose VLM client
answers from the recorded outputs, then ``ParseResult.save`` (``markdown.md``, read back as bytes)
and ``render_content_list`` on the materialized middle JSON, serialized as mineru's CLI writes it.
The local layout model (PP-DocLayoutV2) finds nothing and the OCR text detector finds no line: both
need weights. Only official code and this module run on that side: a content request is matched to
its recorded output by the box, type and angle of the official block against the recorded layout
lines (read with mineru-vl-utils' own line grammar), and each window's pages are found by the page
images official hands to its layout step.

mineru-fast path: ``protocol.page`` and ``results.finish`` on the same page image and outputs, then
``writer.DocumentWriter`` (2.x layout, which has the content list) page by page; its files are read
back as bytes.

Needs the official packages (``mineru``, ``mineru-vl-utils``, ``docvortex``); imported only by
``test_official_compat.py``, which skips without them.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mineru_fast.protocol.page import ContentOutput, plan_content, read_layout
from mineru_fast.protocol.traces import PageTrace
from mineru_fast.results.finish import finish_blocks
from mineru_fast.results.page import Page
from mineru_fast.results.writer import DocumentWriter

ANGLES = {"<|rotate_up|>": 0, "<|rotate_right|>": 90, "<|rotate_down|>": 180, "<|rotate_left|>": 270}


@dataclass
class RecordedPage:
    """One page's recorded outputs as plain data: the layout text and one content per layout line."""

    layout: str
    contents: list[str | None] = field(default_factory=list)

    def content_of(self, block) -> str:
        """The recorded content of an official ``ContentBlock`` ("" when none was recorded).

        Lines are read with mineru-vl-utils' own layout grammar (``mineru_client._layout_re``); the
        j-th matching line owns ``contents[j]``. Official reads an ``unknown`` line as an image.
        """
        from mineru_vl_utils.mineru_client import _layout_re

        wanted = (*(round(v * 1000) for v in block.bbox), block.type, block.angle)
        for j, match in enumerate(re.finditer(_layout_re, self.layout, re.DOTALL)):
            x1, y1, x2, y2 = (int(v) for v in match.group(1, 2, 3, 4))
            kind = match.group(5).lower()
            kind = "image" if kind == "unknown" else kind
            angle = ANGLES.get(match.group(6) or "")
            if (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2), kind, angle) == wanted:
                return (self.contents[j] if j < len(self.contents) else None) or ""
        raise AssertionError(f"no recorded line for official block {block.type} {block.bbox}")


class ReplayVlmClient:
    """A mineru-vl-utils VLM client that answers layout and content prompts from recorded pages.

    Layout requests take the next pages in document order (official sends one window at a time);
    content requests are answered from the blocks ``prepare_for_extract`` chose, page by page.
    """

    def __init__(self) -> None:
        self.pages: list[RecordedPage] = []
        self.cursor = 0  # the next page a layout request answers
        self.page_of_image: dict[int, int] = {}  # id(page image) -> page number, for this window
        self.prepared: dict[int, list] = {}  # page number -> the blocks it asks content for

    def reset(self, pages: list[RecordedPage]) -> None:
        self.pages, self.cursor = pages, 0
        self.page_of_image.clear()
        self.prepared.clear()

    def batch_predict(self, images, prompts, params=None, priority=None, **_):
        from mineru_vl_utils.mineru_client import DEFAULT_PROMPTS

        prompts = [prompts] * len(images) if isinstance(prompts, str) else list(prompts)
        if prompts and all(p == DEFAULT_PROMPTS["[layout]"] for p in prompts):
            window = self.pages[self.cursor : self.cursor + len(images)]
            self.cursor += len(images)
            return [page.layout for page in window]
        out = [self.pages[n].content_of(block) for n in sorted(self.prepared) for block in self.prepared[n]]
        self.prepared.clear()
        if len(out) != len(images):
            raise AssertionError(f"replay matched {len(out)} crops to {len(images)} requests")
        return out

    def predict(self, image, prompt, params=None, priority=None):
        return self.batch_predict([image], [prompt], [params], [priority])[0]


_CLIENT = ReplayVlmClient()


def install() -> None:
    """Route the official pipeline to the replay client and stub the weight-bound local models."""
    import mineru.backend.analysis.pdf.pipeline as pipeline
    import mineru.model.runtime.hybrid as hybrid
    import mineru_vl_utils.mineru_client as client_module

    if getattr(client_module, "_mineru_fast_replay", False):
        return
    client_module.new_vlm_client = lambda **_: _CLIENT

    class _NoLayout:
        @staticmethod
        def batch_predict(images, batch_size=1):
            return [[] for _ in images]

    class _NoLines:
        @staticmethod
        def batch_predict(images, batch_size, **_):
            return [(None, None) for _ in images]

    class _LocalModels:
        device = "cpu"
        layout_model = _NoLayout()
        ocr_model = type("Ocr", (), {"text_detector": _NoLines()})()

    hybrid.HybridLocalModelContextSingleton.get_model = lambda self: _LocalModels()
    # As mineru 4.0.12 builds its client (model/vlm/runtime.py), minus the engine; image analysis is
    # decided per call by MinerUParser(image_analysis=...).
    vlm = client_module.MinerUClient(
        backend="transformers",
        model=object(),
        processor=object(),
        enable_table_formula_eq_wrap=True,
        image_analysis=True,
        enable_cross_page_table_merge=False,
        use_tqdm=False,
    )
    # Only this client's methods are wrapped: mineru-fast's side runs the same library.
    original_layout, original_prepare = vlm.batch_layout_detect, vlm.helper.prepare_for_extract

    def batch_layout_detect(images, *args, **kwargs):
        _CLIENT.page_of_image = {id(image): _CLIENT.cursor + n for n, image in enumerate(images)}
        return original_layout(images, *args, **kwargs)

    def prepare(image, blocks, not_extract_list=None, image_analysis=None):
        page = _CLIENT.page_of_image[id(image)]
        result = original_prepare(image, blocks, not_extract_list, image_analysis)
        _CLIENT.prepared[page] = [blocks[i] for i in result[3]]
        return result

    vlm.batch_layout_detect, vlm.helper.prepare_for_extract = batch_layout_detect, prepare
    pipeline.get_vlm_predictor = lambda config=None: (vlm, "transformers")
    client_module._mineru_fast_replay = True


def official_outputs(document: Path, pages: list[RecordedPage], *, image_analysis: bool) -> tuple[bytes, bytes]:
    """``(markdown.md bytes, content list JSON bytes)`` of official mineru for a document and its
    recorded outputs; the content list is serialized as mineru's CLI writes its JSON files
    (``json.dumps(..., ensure_ascii=False, indent=2)``, UTF-8)."""
    from docvortex.export import materialize_middle
    from mineru.parser.mineru_parser import MinerUParser
    from mineru.parser.writer import FileBasedDataWriter
    from mineru.render.content_list import render_content_list

    install()
    _CLIENT.reset(pages)
    result = MinerUParser(tier="advanced", image_analysis=image_analysis).parse(document)
    if _CLIENT.cursor != len(pages):
        raise AssertionError(f"official asked the layout of {_CLIENT.cursor} pages, the document has {len(pages)}")
    with tempfile.TemporaryDirectory() as tmp:
        result.save(FileBasedDataWriter(tmp))
        markdown = Path(tmp, "markdown.md").read_bytes()
    middle, _ = materialize_middle(result.middle_json)
    items = render_content_list(middle)
    return markdown, json.dumps(items, ensure_ascii=False, indent=2).encode("utf-8")


def fast_page(image: Image.Image, trace: PageTrace, index: int, *, image_analysis: bool) -> Page:
    """A page through mineru-fast's protocol functions with the trace's outputs (no engine)."""
    layout = read_layout(trace.layout)
    requests = plan_content(image, layout, image_analysis=image_analysis)
    outputs = {r.block_index: ContentOutput(trace.content_for(layout.blocks[r.block_index]) or "") for r in requests}
    return Page(index, image.size, finish_blocks(layout, outputs), image=image)


def fast_outputs(images: list[Image.Image], pages: list[PageTrace], *, image_analysis: bool) -> tuple[bytes, bytes]:
    """``(Markdown bytes, content list bytes)`` that mineru-fast's ``DocumentWriter`` writes for the
    same pages, added one at a time as a parse does."""
    with tempfile.TemporaryDirectory() as tmp:
        # The 2.x layout: the one with a content list (its Markdown is the bundle's markdown.md,
        # written the same way; test_official_bundle compares the bundle).
        with DocumentWriter(tmp, "doc", layout="2.x", overlays=False) as writer:
            for i, (image, trace) in enumerate(zip(images, pages, strict=True)):
                writer.add_page(fast_page(image, trace, i, image_analysis=image_analysis))
        return (Path(tmp) / "doc.md").read_bytes(), (Path(tmp) / "doc_content_list.json").read_bytes()
