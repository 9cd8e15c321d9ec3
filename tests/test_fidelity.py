"""Fidelity against the float32 engine: the step arithmetic, the page's requests, thresholds on the tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import WORKLOAD, need

from mineru_fast import ParserOptions
from mineru_fast.bench.fidelity import FP32, Agreement, compare, page_requests
from mineru_fast.bench.workload import load_workload
from mineru_fast.protocol.traces import layout_lines

# Layout types mineru-vl-utils 2.0.7 does not read without image analysis (prepare_for_extract):
# containers, and images / charts.
NOT_READ = {"list", "equation_block", "image_block", "image", "chart", "unknown"}


def test_agreement_counts_steps_exactly():
    a = Agreement()
    a.add("layout", torch.tensor([1.0, 0.0, 0.0]), torch.tensor([2.0, 0.0, 0.0]))  # same top-1, cosine 1
    a.add("text", torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0]))  # different top-1, cosine 0
    s = a.summary()
    assert (s["steps"], s["top1_pct"], s["mean_cosine"], s["min_cosine"]) == (2, 50.0, 0.5, 0.0)
    assert s["by_task"]["layout"] == {"steps": 1, "top1_pct": 100.0, "mean_cosine": 1.0}


def test_page_requests_follow_the_parser():
    page = load_workload(1)[0]
    requests = page_requests(page, ParserOptions())
    lines = layout_lines(page.trace.layout)
    readable = [c for line, c in zip(lines, page.trace.contents, strict=True) if line.type not in NOT_READ and c]
    assert requests[0][0] == "layout" and requests[0][1].forced_text == page.trace.layout
    assert [r.forced_text for _, r in requests[1:]] == readable


@pytest.fixture(scope="module")
def engines(tiny_model):
    from mineru_fast.engine.factory import build_engine

    def build(preset: str, **overrides: object):
        return build_engine(tiny_model, ParserOptions.preset(preset, threads=1, slots=1, **overrides))

    return {
        "fp32": build(FP32["preset"], **FP32["overrides"]),
        "exact": build("exact"),
        "int8": build("fast", int8_kernel="onednn"),
        "bf16": build("bf16"),
    }


@pytest.mark.slow
def test_tiny_model_fidelity_thresholds(engines):
    """Teacher-forced steps of the median page's first four crops (~370 steps; the layout request
    alone would triple the time).

    Thresholds, from what each format keeps: the exact preset is float32 math on the same values,
    so it agrees on every step (cosine 1 up to summation order). bfloat16 keeps 8 significant bits
    in weights and activations; INT8 keeps ~7-8 bits per matmul input with exact integer sums.
    The tiny model's random weights give logits whose two best values are often close, so a few
    top-1 flips are expected: measured here 99.7% (bf16) and 97.8-99.2% (per-token INT8) top-1,
    mean cosine 0.99997 and 0.99968. The bounds leave about 3x that margin: top-1 >= 99% / 95%,
    mean cosine >= 0.9999 / 0.999.
    """
    requests = page_requests(load_workload(1)[0], ParserOptions())[1:5]
    fp32 = engines.pop("fp32")
    results = compare(engines, fp32, requests)
    assert results["exact"]["top1_pct"] == 100.0 and results["exact"]["min_cosine"] > 1 - 1e-9
    assert results["bf16"]["top1_pct"] >= 99.0 and results["bf16"]["mean_cosine"] >= 0.9999
    assert results["int8"]["top1_pct"] >= 95.0 and results["int8"]["mean_cosine"] >= 0.999
    assert results["int8"]["steps"] == results["bf16"]["steps"] > 300


def test_step_groups_count_tasks_token_classes_and_confident_steps():
    from mineru_fast.bench.fidelity import SPECIAL_FROM, StepGroups

    groups = StepGroups()
    targets = torch.tensor([5, SPECIAL_FROM + 16, 7])  # plain, special (an OTSL token), plain
    groups.add("table", targets, torch.tensor([True, False, True]), torch.tensor([1.0, 0.5, 0.9], dtype=torch.float64),
               torch.tensor([True, True, False]))  # fmt: skip
    s = groups.summary()["groups"]
    assert s["all"] == {"steps": 3, "top1_pct": 100 * 2 / 3, "mean_cosine": pytest.approx(0.8)}
    assert s["special"] == {"steps": 1, "top1_pct": 0.0, "mean_cosine": 0.5}
    assert s["confident"]["steps"] == 2 and s["confident"]["top1_pct"] == 50.0
    assert s["confident plain text"] == {"steps": 1, "top1_pct": 100.0, "mean_cosine": 1.0}
    assert s["table"]["steps"] == 3 and groups.summary()["min_cosine"] == 0.5


def test_free_running_summary():
    from mineru_fast.bench.fidelity import _free_summary

    out = _free_summary([[1, 2, 3], [1, 9, 9, 9], [4]], [[1, 2, 3], [1, 2, 3, 4], [5]], ["text", "text", "table"])
    assert out["all"] == {"blocks": 3, "identical": 1, "identical_pct": 100 / 3, "median_tokens_to_divergence": 1}
    assert out["text"]["median_tokens_to_divergence"] == 2  # 3 (identical: its length) and 1
    assert out["table"]["identical"] == 0


def test_confident_rule_is_the_float32_top1_probability():
    from mineru_fast.bench.fidelity import CONFIDENT_P, ReferenceSteps

    logits = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 0.9]])
    ref = ReferenceSteps.of(logits)
    assert CONFIDENT_P == 0.5 and ref.top1.tolist() == [0, 0] and ref.confident.tolist() == [True, False]
    assert ref.logits.dtype == torch.float16


def test_one_prefill_gives_the_forced_steps_of_step_by_step_decoding(engines):
    """The chunked prefill (one chunk per forced token) predicts each step from the same prefix as
    prefill + one decode per token: float32 logits equal up to summation order."""
    from mineru_fast.bench.fidelity import forced_logits, forced_logits_prefill

    _, request = page_requests(load_workload(1)[0], ParserOptions())[1]
    one_pass = forced_logits_prefill(engines["fp32"], request)
    stepwise = torch.stack(list(forced_logits(engines["fp32"], request)))
    assert one_pass.shape == stepwise.shape and one_pass.shape[0] == len(
        engines["fp32"].preprocessor.encode(request).forced
    )
    torch.testing.assert_close(one_pass, stepwise, rtol=1e-4, atol=1e-4)
    assert torch.equal(one_pass.argmax(-1), stepwise.argmax(-1))


def test_content_requests_are_small_images_with_ground_truth():
    from mineru_fast.bench.fidelity import CONTENT_IMAGE, FREE_TOKENS, content_requests

    pages = load_workload(2, need(WORKLOAD))
    forced, free = content_requests(pages, ParserOptions(), len, forced_steps=50, free_blocks=1)
    tasks = [task for task, _ in forced]
    assert set(tasks) <= {"text", "table", "equation"} and "text" in tasks
    assert all(r.image.size == CONTENT_IMAGE and r.forced_text for _, r in forced)
    for task in set(tasks):  # blocks are taken until the budget (here characters) is reached
        lengths = [len(r.forced_text) for t, r in forced if t == task]
        assert sum(lengths[:-1]) < 50
    assert all(r.forced_text is None and r.sampling.max_new_tokens == FREE_TOKENS for _, r in free)
    assert len({task for task, _ in free}) == len(free)  # one per block type


def test_greedy_from_top_applies_the_rules_to_the_tokens_given():
    """Penalties move the choice among the given tokens; a winner that could lie outside them,
    a prefix that cannot be asked, and the end token each end the decode as they should."""
    from mineru_fast.bench.fidelity import greedy_from_top
    from mineru_fast.protocol.spec import SamplingParams

    presence = SamplingParams(presence_penalty=1.0, max_new_tokens=3)
    three = [(5, -0.1), (6, -0.2), (7, -3.0)]
    # 5 first; then 5 costs 1.0 more (-1.1) and 6 (-0.2) wins; then 5 (-1.1) beats 6 (-1.2)
    assert greedy_from_top(lambda prefix: three, presence, 16, [9]) == ([5, 6, 5], "ok")
    two = [(5, -0.1), (6, -0.2)]  # at the third step both are penalized below -0.2: a token not given may win
    assert greedy_from_top(lambda prefix: two, presence, 16, [9]) == ([5, 6], "undetermined")
    assert greedy_from_top(lambda prefix: None if prefix else two, presence, 16, [9]) == ([5], "untokenizable")
    ending = [(9, -0.01), (5, -5.0)]
    assert greedy_from_top(lambda prefix: ending, presence, 16, [9]) == ([9], "ok")
    with pytest.raises(ValueError, match="repetition penalty"):
        greedy_from_top(lambda prefix: ending, SamplingParams(repetition_penalty=1.05), 16, [9])


def test_greedy_from_top_reproduces_the_engines_own_free_run(engines):
    """Fed the engine's own logits (its 20 best tokens at each step, from prefill + decode steps as
    the engine's loop computes them), the oracle decode gives the engine's free-running tokens:
    the protocol's rules (penalties, bans, the end token) are applied as the engine applies them."""
    from dataclasses import replace

    from mineru_fast.bench.fidelity import _prompt_embeds, greedy_from_top

    engine = engines["fp32"]
    _, request = page_requests(load_workload(1)[0], ParserOptions())[1]
    request = replace(request, forced_text=None, sampling=replace(request.sampling, max_new_tokens=40))

    @torch.inference_mode()
    def top(prefix: list[int]) -> list[tuple[int, float]]:
        encoded, embeds, positions = _prompt_embeds(engine, request)
        logits = engine.lm.prefill(embeds[None], positions[:, None], 0)[0]
        rope, cache = int(positions.max()) + 1, len(encoded.input_ids)
        for step, token in enumerate(prefix):
            logits = engine.lm.decode(torch.tensor([token]), torch.tensor([rope + step]), torch.tensor([cache + step]))[
                0
            ]
        values, ids = logits.topk(20)
        return list(zip(ids.tolist(), values.tolist(), strict=True))

    expected = engine.generate([request])[0].token_ids
    tokens, status = greedy_from_top(top, request.sampling, engine.vocab_size, engine.preprocessor.end_ids)
    assert status == "ok" and tokens == expected and len(expected) > 5


class _FakeLlamaServer:
    """llama-server's three endpoints LlamaCppSteps uses, answered with this package's tokenizer
    (llama.cpp's tokenizes Qwen2 text the same way) and an image of ``image_tokens`` tokens."""

    marker = "<__media_test__>"

    def __init__(self, preprocessor, image_tokens: int) -> None:
        self.pre, self.image_tokens, self.bodies = preprocessor, image_tokens, []

    def call(self, path: str, body: dict | None = None) -> dict:
        if path == "/props":
            return {"media_marker": self.marker}
        if path == "/tokenize":
            return {"tokens": self.pre.text_ids(body["content"])}
        self.bodies.append(body)
        before, rest = body["prompt"]["prompt_string"].split(self.marker)
        evaluated = len(self.pre.text_ids(before + "<|vision_start|>")) + self.image_tokens
        evaluated += len(self.pre.text_ids("<|vision_end|>" + rest))
        return {
            "tokens_evaluated": evaluated,
            "completion_probabilities": [{"top_logprobs": [{"id": 7, "logprob": -0.5}]}],
        }


def test_llama_cpp_steps_send_the_engines_prompt_and_refuse_what_does_not_round_trip(engines):
    import base64
    import io

    from PIL import Image

    from mineru_fast.bench.fidelity import CONTENT_IMAGE, CONTENT_IMAGE_TOKENS, LLAMA_CPP_TOP, LlamaCppSteps
    from mineru_fast.errors import BenchmarkError

    pre = engines["fp32"].preprocessor
    _, request = page_requests(load_workload(1)[0], ParserOptions())[1]
    request = replace(request, image=request.image.resize(CONTENT_IMAGE))
    encoded = pre.encode(request)
    image_tokens = int((encoded.input_ids == pre.image_token_id).sum())
    server = _FakeLlamaServer(pre, image_tokens)
    steps = LlamaCppSteps(server, pre)
    prompt = steps.prompt(request)
    assert prompt.tokens == len(encoded.input_ids) and image_tokens == CONTENT_IMAGE_TOKENS == 8
    assert Image.open(io.BytesIO(base64.b64decode(prompt.png_b64))).tobytes() == request.image.tobytes()
    prefix = pre.text_ids("Hello")
    assert steps.top(prompt, prefix) == [(7, -0.5)]
    body = server.bodies[-1]
    assert body["n_predict"] == 1 and body["n_probs"] == LLAMA_CPP_TOP and body["cache_prompt"] is True
    assert body["logit_bias"] == [[pre.tokenizer.token_to_id("a"), 1e4]]
    text = body["prompt"]["prompt_string"]
    assert text.count(server.marker) == 1 and text.endswith("assistant\nHello")
    split = pre.text_ids("龘")  # a character the vocabulary holds as byte-level tokens (3 bytes, 2 tokens)
    assert len(split) > 1 and steps.top(prompt, split[:1]) is None
    server.image_tokens = 4  # llama.cpp giving the image another number of tokens is an error, not a row
    with pytest.raises(BenchmarkError, match="evaluated"):
        steps.top(prompt, prefix)
