"""Replay the same raw model outputs through official MinerU 4.0.12 and through mineru-fast.

Official path: ``MinerUParser(tier="advanced").parse`` -> ``doc_analyze`` (effort ``xhigh``) ->
``MinerUClient.batch_two_step_extract`` whose VLM client answers from the trace, then
``ParseResult.save`` (Markdown) and ``render_content_list`` on the materialized middle JSON. The
local layout model (PP-DocLayoutV2) finds nothing and the OCR text detector finds no line: both need
weights. mineru-fast path: ``page_protocol`` + ``writer`` on the same page image and trace.

Needs the official packages (``mineru``, ``mineru-vl-utils``, ``docvortex``); imported only by
``test_official_compat.py``, which skips without them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from PIL import Image

from mineru_fast.document import Page
from mineru_fast.page_protocol import ContentOutput, finish_blocks, plan_content, read_layout
from mineru_fast.traces import PageTrace
from mineru_fast.writer import join_markdown, render_page


class ReplayVlmClient:
    """A mineru-vl-utils VLM client that answers layout and content prompts from traces.

    Content requests are matched to blocks through ``prepare_for_extract`` (wrapped in ``install``),
    which the official client calls page by page right before predicting that batch.
    """

    def __init__(self) -> None:
        self.pages: list[PageTrace] = []
        self.prepared: list[tuple[int, list]] = []

    def batch_predict(self, images, prompts, params=None, priority=None, **_):
        from mineru_vl_utils.mineru_client import DEFAULT_PROMPTS

        prompts = [prompts] * len(images) if isinstance(prompts, str) else list(prompts)
        if prompts and all(p == DEFAULT_PROMPTS["[layout]"] for p in prompts):
            return [page.layout for page in self.pages[: len(images)]]
        out = [self.pages[page].content_for(block) or "" for page, blocks in self.prepared for block in blocks]
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
    original = client_module.MinerUClientHelper.prepare_for_extract

    def prepare(self, image, blocks, not_extract_list=None, image_analysis=None):
        result = original(self, image, blocks, not_extract_list, image_analysis)
        _CLIENT.prepared.append((len(_CLIENT.prepared), [blocks[i] for i in result[3]]))
        return result

    client_module.MinerUClientHelper.prepare_for_extract = prepare
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
    # As mineru 4.0.12 builds its client (model/vlm/runtime.py), minus the engine.
    vlm = client_module.MinerUClient(
        backend="transformers",
        model=object(),
        processor=object(),
        enable_table_formula_eq_wrap=True,
        image_analysis=True,
        enable_cross_page_table_merge=False,
        use_tqdm=False,
    )
    pipeline.get_vlm_predictor = lambda config=None: (vlm, "transformers")
    client_module._mineru_fast_replay = True


def official_outputs(document: Path, pages: list[PageTrace]) -> tuple[str, str]:
    """``(markdown, content_list JSON text)`` of official mineru for a document and its traces."""
    from docvortex.export import materialize_middle
    from mineru.parser.mineru_parser import MinerUParser
    from mineru.parser.writer import FileBasedDataWriter
    from mineru.render.content_list import render_content_list

    install()
    _CLIENT.pages = pages
    _CLIENT.prepared.clear()
    result = MinerUParser(tier="advanced").parse(document)
    with tempfile.TemporaryDirectory() as tmp:
        result.save(FileBasedDataWriter(tmp))
        markdown = Path(tmp, "markdown.md").read_text(encoding="utf-8")
    middle, _ = materialize_middle(result.middle_json)
    return markdown, json.dumps(render_content_list(middle), ensure_ascii=False, indent=2)


def fast_page(image: Image.Image, trace: PageTrace, index: int, *, image_analysis: bool = True) -> Page:
    """A page through mineru-fast's protocol functions with the trace's outputs (no engine)."""
    layout = read_layout(trace.layout)
    requests = plan_content(image, layout, image_analysis=image_analysis)
    outputs = {r.block_index: ContentOutput(trace.content_for(layout.blocks[r.block_index]) or "") for r in requests}
    return Page(index, image.size, finish_blocks(layout, outputs), image=image)


def fast_outputs(images: list[Image.Image], pages: list[PageTrace]) -> tuple[str, str]:
    """``(markdown, content_list JSON text)`` of mineru-fast for the same pages."""
    pairs = enumerate(zip(images, pages, strict=True))
    rendered = [render_page(fast_page(image, trace, i)) for i, (image, trace) in pairs]
    items = [item for page in rendered for item in page.content_list]
    return join_markdown([page.markdown for page in rendered]), json.dumps(items, ensure_ascii=False, indent=2)
