"""Microbenchmarks of the hot parts, on the tiny synthetic model (``pytest benchmarks/ --benchmark-only``)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.sampling import BatchLogitsProcessor
from mineru_fast.engine.scheduler import SequenceState
from mineru_fast.inputs.documents import open_document
from mineru_fast.protocol.page import ContentOutput, read_layout
from mineru_fast.protocol.spec import LAYOUT_TASK, SamplingParams, layout_image, prompt_for, sampling_for
from mineru_fast.results.finish import finish_blocks


def page_image() -> Image.Image:
    page = Image.new("RGB", (1700, 2200), "white")
    draw = ImageDraw.Draw(page)
    for i in range(40):
        draw.text((100, 100 + 50 * i), f"line {i} of a benchmark page", fill="black")
    return page


@pytest.fixture(scope="module")
def layout_sequence(tiny_engine):
    request = GenerationRequest(layout_image(page_image()), prompt_for(LAYOUT_TASK), sampling_for(LAYOUT_TASK))
    seq = SequenceState(0, request, tiny_engine.preprocessor.encode(request))
    tiny_engine.encode_images([seq])
    return seq


def test_vision_encoder_layout_page(benchmark, tiny_engine, layout_sequence):
    encoded = layout_sequence.encoded
    with torch.inference_mode():
        benchmark(tiny_engine.vision, encoded.pixel_values, [encoded.grid_thw])


def test_prefill_layout_prompt(benchmark, tiny_engine, layout_sequence):
    benchmark(tiny_engine.prefill, layout_sequence, 0)


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_step(benchmark, tiny_engine, batch):
    tokens, positions = torch.zeros(batch, dtype=torch.long), torch.full((batch,), 1500)
    with torch.inference_mode():
        benchmark(tiny_engine.lm.decode, tokens, positions, positions)


def test_logits_processors_batch16(benchmark):
    rules = BatchLogitsProcessor([SamplingParams(1.0, 0.05, 100, 4096)] * 16, [None] * 16, 151936)
    for step in range(300):
        rules.observe([(step * 7 + row) % 500 for row in range(16)])
    logits = torch.randn(16, 151936)
    benchmark(lambda: rules(logits.clone()))


def test_image_preprocessing_layout(benchmark, tiny_engine):
    request = GenerationRequest(layout_image(page_image()), prompt_for(LAYOUT_TASK), sampling_for(LAYOUT_TASK))
    benchmark(tiny_engine.preprocessor.encode, request)


def test_pdf_render_200dpi(benchmark):
    buf = io.BytesIO()
    page_image().save(buf, format="PDF", resolution=200.0)
    data = buf.getvalue()

    def render() -> Image.Image:
        with open_document(data) as doc:
            return doc.render(0)

    benchmark(render)


def test_table_postprocess_large_table(benchmark):
    """Layout parsing + mineru-vl-utils post-processing (OTSL -> HTML) of one large table block."""
    otsl = ("<fcel>cell" * 12 + "<nl>") * 60 + ("<ucel>" + "<fcel>x" * 11 + "<nl>") * 10
    layout = "<|box_start|>100 100 900 900<|box_end|><|ref_start|>table<|ref_end|><|rotate_up|>"
    blocks = benchmark(lambda: finish_blocks(read_layout(layout), {0: ContentOutput(otsl)}))
    assert blocks[0].content.startswith("<table>")
