"""Tier 2: the reference engine on the tiny model, against transformers and a brute-force loop."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from samples import text_page

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.protocol.spec import SamplingParams, prompt_for

NO_RULES = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, no_repeat_ngram_size=0, max_new_tokens=24)
TEXT_RULES = SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, no_repeat_ngram_size=3, max_new_tokens=24)


@pytest.fixture(scope="module")
def crop() -> Image.Image:
    return text_page().crop((40, 40, 700, 400))


def test_plain_greedy_equals_transformers_generate(reference_engine, crop):
    (result,) = reference_engine.generate([GenerationRequest(crop, prompt_for("text"), NO_RULES)])
    inputs = reference_engine.encode(GenerationRequest(crop, prompt_for("text"), NO_RULES))
    with torch.inference_mode():
        expected = reference_engine.model.generate(
            **inputs, do_sample=False, max_new_tokens=24, eos_token_id=reference_engine.end_ids
        )
    assert result.token_ids == expected[0, inputs["input_ids"].shape[1] :].tolist()
    assert result.finish_reason == ("stop" if result.token_ids[-1] in reference_engine.end_ids else "length")


def brute_force_decode(engine, request: GenerationRequest) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by full recomputation (no KV cache) with penalties written out literally."""
    inputs = engine.encode(request)
    ids = inputs["input_ids"]
    generated: list[int] = []
    logits_seen = []
    p = request.sampling
    with torch.inference_mode():
        for _ in range(p.max_new_tokens):
            types = (ids == engine.model.config.image_token_id).to(torch.int32)
            out = engine.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=types,
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
            )
            logits = out.logits[0, -1].float().clone()
            logits_seen.append(logits.clone())
            for token in set(generated):
                logits[token] -= p.presence_penalty + p.frequency_penalty * generated.count(token)
            n = p.no_repeat_ngram_size
            if n and len(generated) >= n - 1:
                tail = generated[len(generated) - (n - 1) :]
                for i in range(len(generated) - n + 1):
                    if generated[i : i + n - 1] == tail:
                        logits[generated[i + n - 1]] = -torch.inf
            token = int(logits.argmax())
            generated.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in engine.end_ids:
                break
    return generated, logits_seen


def test_penalties_and_ngram_ban_match_a_brute_force_loop(reference_engine, crop):
    request = GenerationRequest(crop, prompt_for("text"), TEXT_RULES)
    (result,) = reference_engine.generate([request])
    expected, _ = brute_force_decode(reference_engine, request)
    # Same decisions; the cached and uncached forwards differ only by float rounding (~1e-6),
    # far below the gaps between the tiny model's top logits.
    assert result.token_ids == expected
    (plain,) = reference_engine.generate([GenerationRequest(crop, prompt_for("text"), NO_RULES)])
    assert plain.token_ids != result.token_ids  # the rules really change the output here


def test_replay_reproduces_the_trace_exactly(reference_engine, crop):
    text = "<|box_start|>010 020 500 080<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>\n表 1 <fcel>x<nl>"
    rules = SamplingParams(max_new_tokens=100)
    (result,) = reference_engine.generate([GenerationRequest(crop, prompt_for("layout"), rules, forced_text=text)])
    assert result.text == text
    assert result.finish_reason == "stop"
    assert result.token_ids == reference_engine.preprocessor.forced_ids(text)
    short = SamplingParams(max_new_tokens=5)
    (cut,) = reference_engine.generate([GenerationRequest(crop, prompt_for("layout"), short, forced_text=text)])
    assert cut.finish_reason == "length" and cut.token_ids == reference_engine.preprocessor.forced_ids(text)[:5]


def test_timings_split_into_vision_prefill_decode(reference_engine, crop):
    (result,) = reference_engine.generate([GenerationRequest(crop, prompt_for("text"), NO_RULES)])
    assert result.vision_s > 0 and result.prefill_s > 0 and result.decode_s > 0
    assert (
        result.prompt_tokens == len(reference_engine.encode(GenerationRequest(crop, "", NO_RULES))["input_ids"][0]) + 4
    )


def test_a_failing_request_does_not_sink_the_batch(reference_engine, crop):
    bad = GenerationRequest(Image.new("RGB", (2, 600)), prompt_for("text"), NO_RULES)  # ratio > 200: refused
    good = GenerationRequest(crop, prompt_for("text"), NO_RULES)
    results = reference_engine.generate([bad, good])
    assert results[0].finish_reason == "error" and results[0].error
    assert results[1].finish_reason in ("stop", "length") and results[1].token_ids
