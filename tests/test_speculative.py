"""Speculative decoding: the drafts' proposer, and the same tokens and log-probabilities as plain decoding."""

from __future__ import annotations

import dataclasses

import numpy
import pytest
from conftest import CORPUS, WORKLOAD
from stepping import stepped_generate

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.speculative import FIRST_LENGTH, DraftProposer
from mineru_fast.protocol.spec import SamplingParams as SP


def test_the_proposer_drafts_what_followed_the_latest_occurrence_of_the_longest_suffix():
    proposer = DraftProposer(max_ngram=3, min_ngram=1)
    proposer.length = 10
    # "5 6 7 8" came after "1 2" once and "9" after "2" later: the two-token match wins
    assert proposer.propose([1, 2, 5, 6, 7, 8, 2, 9, 1, 2], 4) == [5, 6, 7, 8]
    proposer = DraftProposer(max_ngram=3, min_ngram=1)
    proposer.length = 10
    # a table row repeated: the most recent row is the draft, cut at k
    row = [100, 7, 100, 8, 101]
    assert proposer.propose(row + row + [100], 3) == [7, 100, 8]
    assert DraftProposer().propose([1, 2, 3, 4], 4) == []  # nothing occurred before: no draft
    assert DraftProposer(min_ngram=2).propose([5, 1, 5], 4) == []  # a one-token match is too short here
    assert DraftProposer(min_ngram=1).propose([5, 1, 5], 4) == [1, 5]
    with pytest.raises(ValueError, match="min_ngram"):
        DraftProposer(max_ngram=1, min_ngram=2)


def test_the_proposer_follows_a_reference_in_order_and_its_prompt_text():
    reference = [10, 11, 12, 10, 11, 13, 14]
    proposer = DraftProposer(reference=reference, max_ngram=2, min_ngram=1)
    proposer.length = 10
    assert proposer.propose([10, 11], 2) == [12, 10]  # the first occurrence
    assert proposer.propose([10, 11, 12, 10, 11], 2) == [13, 14]  # at or after the last one, in order
    assert DraftProposer(reference=reference).propose([99], 3) == []  # no match anywhere
    # the prompt's text is history too (the output repeats a phrase of it)
    prompted = DraftProposer(prompt_text=[7, 8, 9, 6], max_ngram=2, min_ngram=1)
    assert prompted.propose([7, 8], 5) == [9, 6][:FIRST_LENGTH]


def test_the_draft_length_adapts_to_acceptance_and_stays_within_its_bounds():
    proposer = DraftProposer(max_length=5, max_ngram=1, min_ngram=1)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert len(proposer.propose(history, 8)) == FIRST_LENGTH
    proposer.record(FIRST_LENGTH, FIRST_LENGTH)  # all accepted: longer
    assert len(proposer.propose(history, 8)) == FIRST_LENGTH + 2
    proposer.record(FIRST_LENGTH + 2, 1)  # one rejected: shorter
    assert len(proposer.propose(history, 8)) == FIRST_LENGTH + 1
    assert len(proposer.propose(history, 1)) == 1  # this step's room cuts the draft, not the length
    assert proposer.length == FIRST_LENGTH + 1
    proposer.record(3, 3)
    proposer.record(5, 5)
    assert proposer.length == 5  # never past max_length
    for _ in range(6):
        proposer.record(1, 0)
    assert proposer.length == 1 and len(proposer.propose(history, 8)) == 1  # never below one
    proposer.record(0, 0)  # no draft, no feedback
    assert proposer.length == 1
    with pytest.raises(ValueError, match="max_length"):
        DraftProposer(max_length=0)


@pytest.fixture(scope="module")
def fast_engine(tiny_model):
    """The fast preset's engine: its decode rows do not depend on the other rows of a step (block
    kernel, own decode attention), which is what makes verification exact."""
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.options import ParserOptions

    engine = build_engine(tiny_model, ParserOptions.preset("fast", slots=4), prepared_cache=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def stepped_engine(tiny_model):
    """The fast preset's engine with a slot for every request of a workload page (39 at most),
    used only through ``stepping.stepped_generate``: runs compared bit for bit group their prefill
    and vision work the same way."""
    from mineru_fast.engine.factory import build_engine
    from mineru_fast.options import ParserOptions

    engine = build_engine(tiny_model, ParserOptions.preset("fast", slots=40), prepared_cache=False)
    yield engine
    engine.close()


def workload_requests(name: str, traces) -> list[GenerationRequest]:
    """The replayed layout and content requests of one workload page (as ``DocumentParser`` makes
    them), each content request with the tiny model's ``max_new_tokens`` room."""
    from PIL import Image

    from mineru_fast.protocol.page import plan_content, read_layout
    from mineru_fast.protocol.spec import layout_image, prompt_for
    from mineru_fast.protocol.traces import load_trace

    trace = load_trace(traces / f"{name}.json").pages[0]
    image = Image.open(next((WORKLOAD / "images").glob(name + ".*"))).convert("RGB")
    requests = [GenerationRequest(layout_image(image), prompt_for("layout"), SP(max_new_tokens=2500), trace.layout)]
    layout = read_layout(trace.layout)
    for request in plan_content(image, layout, image_analysis=False):
        forced = trace.content_for(layout.blocks[request.block_index])
        if forced is not None:
            requests.append(GenerationRequest(request.image, request.prompt, SP(max_new_tokens=2500), forced))
    return requests


def workload_pages() -> list:
    """The workload's pages as parameters: the first in the default lane, the others slow."""
    if not WORKLOAD.exists():
        return []
    names = sorted(p.stem for p in (WORKLOAD / "images").iterdir())
    return [pytest.param(n, id=n[:40], marks=[pytest.mark.slow] if i else []) for i, n in enumerate(names)]


@pytest.mark.skipif(not WORKLOAD.exists(), reason="../shared workload not present")
@pytest.mark.parametrize("name", workload_pages())
def test_every_replayed_block_of_a_workload_page_gets_the_same_tokens_and_logprobs(
    stepped_engine, workload_traces, name
):
    """Every block of the page (its layout request and every content request, ground truth forced
    as the model's choices) decoded with and without drafts: the same tokens and the same
    log-probabilities bit for bit (every verified position's logits are a plain step's, at another
    row count and beside other slots' rows; admission interleaved with the decode steps, one unit
    per step), in fewer decode steps where drafts were accepted."""
    requests = workload_requests(name, workload_traces)
    plain = stepped_generate(stepped_engine, requests, admission_budget_s=0.0)
    drafted = stepped_generate(
        stepped_engine, [dataclasses.replace(r, speculative=6) for r in requests], admission_budget_s=0.0
    )
    for off, on in zip(plain, drafted, strict=True):
        assert off.finish_reason == on.finish_reason == "stop", (off.error, on.error)
        assert on.token_ids == off.token_ids
        assert on.logprobs == off.logprobs
        assert off.draft_tokens == 0 and off.decode_steps == len(off.token_ids) - 1
        # each accepted draft token saves a step, but for one that ends the output
        assert 0 <= on.decode_steps - (len(on.token_ids) - 1 - on.accepted_tokens) <= 1
    assert sum(r.accepted_tokens for r in drafted) > 0


def test_free_running_sequences_speculating_beside_plain_ones_keep_their_tokens(stepped_engine):
    """Free-running requests (the tiny model's own choices, penalties and the n-gram ban of the
    task's rules on), half of them speculating in the same steps as the others: each gets the
    tokens and log-probabilities it gets without drafts; a step already ``speculative_rows`` wide
    verifies none."""
    from samples import text_page

    from mineru_fast.protocol.spec import LayoutBlock, crop_block, prompt_for, sampling_for

    page = text_page()
    requests = []
    for kind, box in [
        ("text", (0.1, 0.1, 0.9, 0.3)),
        ("table", (0.1, 0.4, 0.9, 0.7)),
        ("equation", (0.3, 0.8, 0.7, 0.85)),
    ]:
        rules = sampling_for(kind)
        sampling = dataclasses.replace(rules, max_new_tokens=120)
        requests.append(GenerationRequest(crop_block(page, LayoutBlock(kind, box)), prompt_for(kind), sampling))
    requests.append(dataclasses.replace(requests[0], sampling=SP(max_new_tokens=120)))  # no rules
    scheduler = stepped_engine.scheduler
    plain = stepped_generate(stepped_engine, requests)
    before = scheduler.draft_tokens, scheduler.accepted_tokens
    mixed = stepped_generate(
        stepped_engine, [dataclasses.replace(r, speculative=4 * (i % 2)) for i, r in enumerate(requests)]
    )
    for off, on in zip(plain, mixed, strict=True):
        assert (on.token_ids, on.logprobs) == (off.token_ids, off.logprobs)
    assert mixed[0].draft_tokens == 0 and sum(r.draft_tokens for r in mixed) > 0
    # the engine's running totals (the server's gauges) are the results' sums
    assert scheduler.draft_tokens - before[0] == sum(r.draft_tokens for r in mixed)
    assert scheduler.accepted_tokens - before[1] == sum(r.accepted_tokens for r in mixed)
    scheduler.speculative_rows = 1  # a step of one live sequence is already as wide as allowed
    try:
        narrow = stepped_generate(stepped_engine, [dataclasses.replace(r, speculative=4) for r in requests])
    finally:
        scheduler.speculative_rows = 8
    assert [r.token_ids for r in narrow] == [r.token_ids for r in plain]
    assert sum(r.draft_tokens for r in narrow) == 0 and scheduler.draft_tokens - before[0] == sum(
        r.draft_tokens for r in mixed
    )


def test_the_pytorch_decode_attention_verifies_the_same(tiny_model):
    """Without the own decode attention (rows of one slot written and read by PyTorch operators):
    the same tokens and log-probabilities with and without drafts."""
    from samples import text_page

    from mineru_fast.engine.factory import build_engine
    from mineru_fast.options import ParserOptions
    from mineru_fast.protocol.spec import prompt_for

    engine = build_engine(tiny_model, ParserOptions.preset("fast", slots=2), prepared_cache=False)
    try:
        engine.lm.use_decode_kernel(None)
        request = GenerationRequest(text_page(), prompt_for("text"), SP(max_new_tokens=150))
        off, on = stepped_generate(engine, [request, dataclasses.replace(request, speculative=5)])
        assert (on.token_ids, on.logprobs) == (off.token_ids, off.logprobs)
        assert on.accepted_tokens > 0
    finally:
        engine.close()


def test_a_bad_speculative_value_fails_alone(fast_engine):
    from samples import text_page

    from mineru_fast.options import MAX_SPECULATIVE, ParserOptions
    from mineru_fast.protocol.spec import prompt_for

    request = GenerationRequest(text_page(), prompt_for("text"), SP(max_new_tokens=5))
    values = [-1, MAX_SPECULATIVE + 1, 1.5, True, "4"]
    *bad, good = fast_engine.generate([*(dataclasses.replace(request, speculative=v) for v in values), request])
    for value, result in zip(values, bad, strict=True):
        assert result.finish_reason == "error" and "speculative must be" in result.error, value
    assert good.finish_reason in ("stop", "length")
    for value in values:
        with pytest.raises(ValueError, match="speculative must be"):
            ParserOptions(speculative=value)
    assert type(ParserOptions(speculative=numpy.int64(6)).speculative) is int  # stored as an int (JSON)
    with pytest.raises(ValueError, match="fast engine only"):
        ParserOptions(engine="reference", speculative=4)
    assert ParserOptions(speculative=MAX_SPECULATIVE).speculative == MAX_SPECULATIVE


def test_draft_text_feeds_the_drafts(stepped_engine):
    """A reference the output follows (here the forced output itself, as a text layer would be)
    is drafted from: nearly every token accepted, the same tokens."""
    from samples import text_page

    from mineru_fast.protocol.spec import prompt_for

    text = "The quick brown fox jumps over the lazy dog, and the five boxing wizards jump quickly."
    request = GenerationRequest(text_page(), prompt_for("text"), SP(max_new_tokens=100), forced_text=text)
    off, on = stepped_generate(stepped_engine, [request, dataclasses.replace(request, speculative=8, draft_text=text)])
    assert on.token_ids == off.token_ids and on.logprobs == off.logprobs
    assert on.accepted_tokens >= len(on.token_ids) - 8  # the draft length grows 2, 4, 6 (8 rows, 2 live)
    assert on.decode_steps < len(off.token_ids) // 3


@pytest.mark.skipif(not CORPUS.exists(), reason="../shared corpus not present")
def test_the_advanced_tier_drafts_text_blocks_from_the_pdf_text_layer(fast_engine, tiny_model, monkeypatch):
    """A born-digital PDF page parsed in the advanced tier with ``speculative``: every request
    carries it, the text-like blocks carry their text-layer text as ``draft_text`` (others none),
    and the page's blocks are those of a parse without drafts (the sample layout's text block lies
    over the page's first column); a text layer that cannot be read or assembled leaves the page
    as it is, without drafts."""
    from samples import sample_trace

    from mineru_fast import DocumentParser
    from mineru_fast.options import ParserOptions

    seen: list[GenerationRequest] = []

    class Spy:
        def __init__(self, engine):
            self.engine = engine

        def submit(self, request):
            seen.append(request)
            return self.engine.submit(request)

        def __getattr__(self, name):
            return getattr(self.engine, name)

    pdf = CORPUS / "multicolumn_2col_latex.pdf"
    docs = {}
    for k in (0, 4):
        options = ParserOptions.preset("fast", slots=4, speculative=k, tier="advanced")
        parser = DocumentParser(Spy(fast_engine), options, tiny_model)
        docs[k] = parser.parse(pdf, pages="1", replay=sample_trace(3))
    drafted = seen[len(seen) // 2 :]
    assert all(r.speculative == 0 for r in seen[: len(seen) // 2]) and all(r.speculative == 4 for r in drafted)
    (body,) = [r.draft_text for r in drafted if r.forced_text == "A replayed paragraph of body text."]
    assert body is not None and "lorem" in body.lower()  # the page's words under the text block
    assert all(r.draft_text is None for r in drafted if r.prompt == seen[0].prompt)  # the layout request's

    def blocks(doc) -> list[dict]:  # log-probabilities aside: the runs' admission is grouped by timing
        return [{k: v for k, v in b.to_dict().items() if k != "confidence"} for b in doc.pages[0].blocks]

    assert blocks(docs[4]) == blocks(docs[0]) and docs[4].status == "success"
    # the page's counts say what the drafts did (and only when they were on)
    off, on = docs[0].pages[0].counts, docs[4].pages[0].counts
    assert "draft_tokens" not in off and on["generated_tokens"] == off["generated_tokens"]
    assert on["draft_tokens"] >= on["accepted_tokens"] >= 0
    # a request's first token comes from its prefill, each accepted draft token saves a step, but
    # for one that ends its output
    plain_steps = on["generated_tokens"] - on["requests"] - on["accepted_tokens"]
    assert 0 <= on["decode_steps"] - plain_steps <= on["requests"]
    assert docs[4].counts["draft_tokens"] == on["draft_tokens"]  # summed per document

    def broken(*args, **kwargs):
        raise RuntimeError("a text layer this reader trips on")

    import mineru_fast.pipeline.parser as parser_module
    from mineru_fast.inputs.documents import OpenedDocument

    options = ParserOptions.preset("fast", slots=4, speculative=4, tier="advanced")
    for target, name in ((parser_module, "block_text"), (OpenedDocument, "page_text")):
        seen.clear()
        with monkeypatch.context() as patch:
            patch.setattr(target, name, broken)
            doc = DocumentParser(Spy(fast_engine), options, tiny_model).parse(pdf, pages="1", replay=sample_trace(3))
        assert doc.status == "success" and blocks(doc) == blocks(docs[0]), name
        assert all(r.draft_text is None for r in seen) and all(r.speculative == 4 for r in seen)


@pytest.mark.skipif(not WORKLOAD.exists(), reason="../shared workload not present")
def test_the_model_free_acceptance_is_the_engines_count_at_batch_1(fast_engine, workload_traces):
    """``bench.speculative`` replays drafts without the model: for a request decoding alone, its
    decode steps, drafts and accepted drafts are the engine's own, and the per-type table sums
    them (what ``mineru-fast bench --workload`` prints)."""
    from mineru_fast.bench import report
    from mineru_fast.bench.speculative import acceptance_by_type, replay_acceptance

    pre = fast_engine.preprocessor
    requests = workload_requests(sorted(p.stem for p in (WORKLOAD / "images").iterdir())[0], workload_traces)
    longest = max(requests[1:], key=lambda r: len(r.forced_text))
    for request in (requests[0], longest):
        (result,) = fast_engine.generate([dataclasses.replace(request, speculative=6)])
        tokens = pre.forced_ids(request.forced_text)
        assert result.token_ids == tokens
        expected = replay_acceptance(tokens, pre.text_ids(request.prompt), 6, request.sampling.max_new_tokens)
        assert (result.decode_steps, result.draft_tokens, result.accepted_tokens) == expected
    layout = requests[0]
    table = acceptance_by_type([("layout", layout.prompt, layout.forced_text, 2500)] * 2, pre, 6)
    steps, proposed, accepted = replay_acceptance(pre.forced_ids(layout.forced_text), pre.text_ids(layout.prompt),
                                                  6, 2500)  # fmt: skip
    row = table["layout"]
    assert (row["decode_steps"], row["proposed"], row["accepted"]) == (2 * steps, 2 * proposed, 2 * accepted)
    assert row["acceptance"] == accepted / proposed
    text = report._speculative({"k": 6, "types": table})
    assert f"| layout | {row['tokens']} | {row['plain_steps']} | {2 * steps} (" in "\n".join(text)
