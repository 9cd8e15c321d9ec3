"""The engine loop: chunked prefill, admission budgets, cancellation, deadlines, log-probs, threads,
the repetition guard. Stepped by hand where the interleaving matters, so nothing depends on timing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from samples import text_page

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.generate import FastEngine
from mineru_fast.engine.repetition import loop_period
from mineru_fast.engine.sampling import NGramBlocker
from mineru_fast.protocol.spec import SamplingParams as SP
from mineru_fast.protocol.spec import layout_image, prompt_for

NUMBERS = " ".join(str(i) for i in range(300))  # ~600 tokens of replayed output


@pytest.fixture(scope="module")
def engine(tiny_model):
    return FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)


def crop_request(seed: int = 0, bound: int = 12, **kwargs: object) -> GenerationRequest:
    crop = text_page(seed=seed).crop((40, 40, 700, 300))
    return GenerationRequest(crop, prompt_for("text"), SP(max_new_tokens=bound), **kwargs)


def run_until_done(scheduler, *handles) -> None:
    while not all(h.done() for h in handles):
        scheduler.step()


def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(tiny_model, engine):
    """Prompts split into 7-token chunks (several sequences per forward) decode to the same tokens
    as prompts prefilled in one forward; logits agree to float32 rounding (different summation
    order in attention, ~1e-6 of logits of magnitude ~10)."""
    requests = [crop_request(seed=s) for s in range(3)]
    requests.append(GenerationRequest(layout_image(text_page()), prompt_for("layout"), SP(max_new_tokens=12)))
    whole = engine.generate(requests)
    chunked = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048, prefill_chunk_tokens=7)
    assert [r.token_ids for r in chunked.generate(requests)] == [r.token_ids for r in whole]
    for a, b in zip(chunked.generate(requests), whole, strict=True):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_admission_work_between_decode_steps_is_bounded(tiny_model):
    """With a zero budget, every step that decodes runs exactly one admission unit (one vision
    block or one prefill forward), however much work waits: a decode step waits for one unit."""
    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048, prefill_chunk_tokens=64)
    scheduler = engine.scheduler
    scheduler.admission_budget_s = 0.0
    units: list[str] = []
    for name in ("_vision_unit", "_prefill_unit"):
        original = getattr(scheduler, name)

        def counted(original=original, name=name) -> None:
            units.append(name)
            original()

        setattr(scheduler, name, counted)
    first = scheduler.submit(crop_request(bound=400, forced_text=NUMBERS), start=False)
    while not scheduler.live:
        scheduler.step()
    later = [
        scheduler.submit(r, start=False)
        for r in [GenerationRequest(layout_image(text_page()), prompt_for("layout"), SP(max_new_tokens=8))]
        + [crop_request(seed=s, bound=8) for s in range(3)]
    ]
    per_step = []
    while not all(h.done() for h in later):
        units.clear()
        had_live = bool(scheduler.live)
        scheduler.step()
        if had_live:
            per_step.append(len(units))
    assert not first.done()  # the long request decoded throughout
    assert per_step and max(per_step) == 1
    first.cancel()
    run_until_done(scheduler, first)


def test_cancel_mid_decode_keeps_the_others_going(tiny_model, engine):
    scheduler = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048).scheduler
    doomed = scheduler.submit(crop_request(bound=400, forced_text=NUMBERS), start=False)
    survivor = scheduler.submit(crop_request(seed=1), start=False)
    while sum(len(s.tokens) for s in scheduler.live.values() if s.handle is doomed) < 5:
        scheduler.step()
    doomed.cancel()
    run_until_done(scheduler, doomed, survivor)
    cancelled = doomed.result()
    assert cancelled.finish_reason == "cancelled" and 5 <= len(cancelled.token_ids) < 400
    assert cancelled.text == NUMBERS[: len(cancelled.text)]
    (alone,) = engine.generate([crop_request(seed=1)])
    assert survivor.result().token_ids == alone.token_ids and survivor.result().finish_reason != "cancelled"
    assert not scheduler.has_work()


def test_a_long_sequence_left_in_a_high_slot_moves_down_and_decodes_as_alone(tiny_model, engine):
    """Three short requests end while a long one, in the highest slot, goes on: it moves into slot
    0 (its KV positions and its decoding rules, penalties and n-gram history included), later steps
    decode one row, and its tokens are those it gets alone (logits to float32 rounding: another
    batch width sums in another order)."""
    rules = SP(max_new_tokens=40, presence_penalty=0.5, frequency_penalty=0.3, no_repeat_ngram_size=3)
    long = GenerationRequest(text_page(seed=5).crop((40, 40, 700, 300)), prompt_for("text"), rules)
    scheduler = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048).scheduler
    widths: list[int] = []
    decode = scheduler.runner.lm.decode

    def recorded(tokens, rope, cache, row_slots):
        widths.append(tokens.shape[0])
        return decode(tokens, rope, cache, row_slots)

    scheduler.runner.lm.decode = recorded
    scheduler.admission_budget_s = float("inf")  # all four admitted in the first step, whatever the timing
    short = [scheduler.submit(crop_request(seed=s, bound=3), start=False) for s in range(3)]
    handle = scheduler.submit(long, start=False)
    scheduler.step()
    assert len(scheduler.live) == 4 and scheduler.live[3].handle is handle
    run_until_done(scheduler, handle, *short)
    assert widths[0] == 4 and widths[-1] == 1 and widths.count(4) <= 3
    (alone,) = engine.generate([long])
    assert len(alone.token_ids) > 10 and handle.result().token_ids == alone.token_ids
    assert np.allclose(handle.result().logprobs, alone.logprobs, atol=1e-4)


def test_deadline_passed_in_the_queue_times_out(engine):
    result = engine.submit(crop_request(deadline=time.monotonic() - 1)).result(timeout=60)
    assert result.finish_reason == "timeout" and result.token_ids == []


def test_request_longer_than_the_kv_buffer_is_refused_up_front(engine):
    (result,) = engine.generate([crop_request(bound=4000)])
    assert result.finish_reason == "error" and "exceeds the KV buffer length 2048" in result.error


def test_logprobs_are_the_models_own(engine, reference_engine):
    """Replayed tokens' log-probabilities (raw logits, before any rule) match the transformers
    reference's within float32 rounding of logits (see test_fast_logits_match_reference)."""
    request = crop_request(bound=40, forced_text="Line 3 of sample text")
    (fast,) = engine.generate([request])
    (reference,) = reference_engine.generate([request])
    assert fast.token_ids == reference.token_ids and len(fast.logprobs) == len(fast.token_ids)
    assert np.allclose(fast.logprobs, reference.logprobs, atol=1e-3)
    assert all(p <= 0 for p in fast.logprobs)


def test_threads_share_one_batch_and_get_their_own_tokens(engine):
    requests = [crop_request(seed=s) for s in range(4)]
    expected = [r.token_ids for r in engine.generate(requests)]
    got: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        got[i] = engine.generate([requests[i]])[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got[i] for i in range(4)] == expected


def cycling_tokens(n: int, period: int = 5, ngram: int = 100) -> list[int]:
    """What a looping model emits under the no-repeat-n-gram ban: it follows a cycle and takes
    its second choice whenever the cycle's next token is banned."""
    blocker, out = NGramBlocker(ngram), []
    for step in range(n):
        token = 100 + step % period
        if token in blocker.banned():
            token = 999
        blocker.append(token)
        out.append(token)
    return out


def test_loop_period_finds_loops_broken_by_the_ngram_ban_and_spares_real_text(tiny_model):
    from transformers import AutoTokenizer

    looping = cycling_tokens(600)
    assert 999 in looping  # the ban did break the cycle
    assert loop_period(looping, 512) == 5
    assert loop_period([7] * 512, 512) == 1 and loop_period([7, 8] * 256, 512) == 2
    assert loop_period(looping[:500], 512) is None  # fewer tokens than the window
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    rows = "".join(f"<fcel>{i * 37 % 1000}<fcel>{i * 91 % 997}.{i % 10}<fcel>{2000 + i}<nl>" for i in range(120))
    prose = " ".join(f"Sentence {i} describes item {i * 13 % 97} of the list." for i in range(80))
    for text in (rows, prose):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= 512 and loop_period(ids, 512) is None


def test_repetition_guard_ends_a_looping_sequence_under_the_ngram_ban(tiny_model):
    """A model forced into a 5-token cycle (its logits rigged after each real forward) with the
    default no-repeat-n-gram rule on: the guard ends it with ``"repetition"`` shortly after the
    window fills, far below its bound. Replay of the same tokens is never cut."""
    engine = FastEngine(tiny_model, precision="fp32", slots=2, max_seq_len=4096, repetition_window=256)
    decode = engine.lm.decode

    def looping_decode(tokens, rope, cache, row_slots):
        logits = decode(tokens, rope, cache, row_slots)
        rigged = torch.linspace(0, -1, logits.shape[1]).repeat(logits.shape[0], 1)
        rigged[torch.arange(logits.shape[0]), 100 + (tokens - 99) % 5] = 10.0
        return rigged

    engine.lm.decode = looping_decode
    (result,) = engine.generate([crop_request(bound=3000)])
    assert result.finish_reason == "repetition"
    assert 256 <= len(result.token_ids) <= 256 + 32
    assert loop_period(result.token_ids, 256) == 5
    replay = engine.preprocessor.decode(result.token_ids)
    (replayed,) = engine.generate([crop_request(bound=3000, forced_text=replay)])
    assert replayed.finish_reason == "stop"


def test_a_decode_step_waits_for_the_budget_or_one_unit_not_both(tiny_model):
    """On a fake clock where a vision block costs 0.8 s, a prefill forward 0.3 s per crop prompt
    and the budget is 0.5 s: after a cheap unit, a unit that would overrun the budget waits for the
    next step, so no decode step waits longer than the budget or the longest single unit (the loop
    used to start a 0.8 s block 0.3 s into the budget: a 1.1 s wait)."""
    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    scheduler = engine.scheduler
    now = [0.0]
    scheduler.clock = lambda: now[0]
    crops = [crop_request(seed=s, bound=8) for s in range(3)]
    encoded = engine.preprocessor.encode(crops[0])
    patches = encoded.pixel_values.shape[0]
    scheduler.admission_budget_s = 0.5
    scheduler.vision_pack_patches = patches  # one crop per pack
    block_s, prefill_s_per_token = 0.8 / patches, 0.3 / len(encoded.input_ids)
    units: list[float] = []
    vision_steps, prefill_chunks, decode = engine.vision_steps, engine.lm.prefill_chunks, engine.lm.decode

    def timed_vision(pixels, grids):
        inner, cost, step = vision_steps(pixels, grids), block_s * pixels.shape[0], 0
        while True:
            try:
                next(inner)
            except StopIteration as stop:  # the merger: free
                return stop.value
            if step:  # step 0 is the patch embedding (free), each later one a block
                now[0] += cost
                units.append(cost)
            step += 1
            yield

    def timed_prefill(chunks):
        cost = prefill_s_per_token * sum(c[0].shape[0] for c in chunks)
        now[0] += cost
        units.append(cost)
        return prefill_chunks(chunks)

    def timed_decode(tokens, rope, cache, row_slots):
        now[0] += 0.01
        return decode(tokens, rope, cache, row_slots)

    engine.vision_steps, engine.lm.prefill_chunks, engine.lm.decode = timed_vision, timed_prefill, timed_decode
    first = scheduler.submit(crop_request(bound=400, forced_text=NUMBERS), start=False)
    with torch.inference_mode():  # as in the engine loop
        while not scheduler.live:
            scheduler.step()
        scheduler.max_decode_wait_s = 0.0
        later = [scheduler.submit(r, start=False) for r in crops]
        run_until_done(scheduler, *later)
        assert not first.done() and all(h.result().finish_reason == "length" for h in later)
        assert scheduler.max_decode_wait_s <= max(scheduler.admission_budget_s, *units) + 1e-9
        first.cancel()
        run_until_done(scheduler, first)


def test_a_lone_image_s_pixels_are_freed_once_embedded_and_no_sequence_keeps_any(tiny_model):
    """A one-image vision pack (a layout image: 26 MB of pixels) is not copied, and its pixels
    are freed as soon as the patch embedding has read them, while the pass goes on; after the pass
    no sequence keeps pixel storage (an empty view ``[:0]`` had kept it until the sequence ended)."""
    import weakref

    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    scheduler = engine.scheduler
    handle = scheduler.submit(crop_request(bound=400, forced_text=NUMBERS), start=False)
    seq = scheduler.inbox.get()  # looked at and put back: the loop has not run yet
    scheduler.inbox.put(seq)
    dim = seq.encoded.pixel_values.shape[1]
    pixels = weakref.ref(seq.encoded.pixel_values)
    with torch.inference_mode():
        scheduler._drain_inbox()
        scheduler._vision_unit()  # the pack's first unit: the patch embedding
        assert scheduler.vision_job is not None and scheduler.vision_pack == [seq]  # the pass goes on
        assert pixels() is None
        while scheduler.vision_job is not None:
            scheduler._vision_unit()
        assert seq.image_embeds is not None and seq.encoded.pixel_values.shape == (0, dim)
        assert seq.encoded.pixel_values.untyped_storage().nbytes() == 0
        run_until_done(scheduler, handle)
    assert handle.result().finish_reason == "length"


def test_a_pack_of_several_images_frees_each_sequence_s_pixels_after_the_pass(tiny_model):
    """A pack of several keeps each sequence's pixels through the pass (they are encoded one by one
    should the pack fail), then lets go of them; the tokens are those of the images alone."""
    requests = [crop_request(seed=s) for s in range(3)]
    reference = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    alone = [reference.generate([r])[0].token_ids for r in requests]
    reference.close()
    scheduler = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048).scheduler  # stepped here
    handles = [scheduler.submit(r, start=False) for r in requests]
    sequences = [scheduler.inbox.get() for _ in requests]
    for seq in sequences:
        scheduler.inbox.put(seq)
    with torch.inference_mode():
        scheduler._drain_inbox()
        scheduler._vision_unit()
        assert len(scheduler.vision_pack) == 3
        assert all(s.encoded.pixel_values.shape[0] > 0 for s in sequences)
        while scheduler.vision_job is not None:
            scheduler._vision_unit()
        assert all(s.encoded.pixel_values.untyped_storage().nbytes() == 0 for s in sequences)
        run_until_done(scheduler, *handles)
    assert [h.result().token_ids for h in handles] == alone
