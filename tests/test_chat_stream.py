"""The chat door as a batch client's VLM server: tokens streamed as they come (SSE), stop strings
cut without sending their start, a queue bounded by memory instead of 429 by count, twins sharing
one generation, and a client that leaves freeing what it held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from samples import text_page
from serve_helpers import running_server
from test_chat import CROP, mineru_body, sse_events, streamed_text

from mineru_fast.engine.base import GenerationRequest, GenerationResult, RequestHandle
from mineru_fast.protocol.spec import SamplingParams, prompt_for
from mineru_fast.serve.chat_admission import ChatAdmission
from mineru_fast.serve.chat_text import IncrementalText, StopCutter, before_stop
from mineru_fast.serve.errors import ApiError

# -- text as tokens come ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preprocessor(tiny_model):
    from mineru_fast.engine.preprocess import Preprocessor

    return Preprocessor(tiny_model)


def test_incremental_text_never_splits_a_character_and_joins_to_the_whole_decode(preprocessor):
    """Byte-level tokens of multi-byte characters (accents, CJK, an emoji, full-width forms) and
    special tokens: no delta holds a half character (U+FFFD), and the deltas join to the decode of
    every id."""
    text = "é 中文表格 😀 ＡＢ１ <|box_start|>100 200<|box_end|> \\(x^2\\)\n| a | b |"
    ids = preprocessor.text_ids(text)
    decode = preprocessor.decode
    texts = IncrementalText(decode)
    deltas = [texts.feed(ids[:n]) for n in range(1, len(ids) + 1)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == decode(ids) == text
    assert sum(1 for d in deltas if d) > 10  # it streamed, not one piece at the end
    assert any(d == "" for d in deltas)  # the emoji's first bytes were held until it was whole


@settings(max_examples=300, deadline=None, database=None)
@given(
    pieces=st.lists(st.text(alphabet="abcXY\n", max_size=4), max_size=12),
    stop=st.lists(st.text(alphabet="abcXY\n", min_size=1, max_size=4), max_size=3),
)
def test_stop_cutter_sends_only_a_prefix_of_the_cut_answer(pieces, stop):
    """Whatever the chunks and stop strings: what is sent at every point is a prefix of the answer
    cut before its first stop string, and with the rest it is that answer exactly. The answer ends
    where the engine ends it: after the piece in which a stop string first appears whole."""
    for n in range(len(pieces)):
        if any(s in "".join(pieces[: n + 1]) for s in stop):
            pieces = pieces[: n + 1]
            break
    full = "".join(pieces)
    expected = before_stop(full, stop)
    cutter = StopCutter(stop)
    sent = ""
    for piece in pieces:
        sent += cutter.add(piece)
        assert expected.startswith(sent)
    assert sent + cutter.finish(full) == expected


# -- the engine reports tokens as they come ------------------------------------------------------------


def test_a_token_listener_that_raises_ends_its_request_alone(tiny_model):
    """The scheduler pushes each token to its handle; a listener that raises ends that request with
    an error, the other request of the batch goes on and its listener saw every token."""
    from mineru_fast import DocumentParser, ParserOptions

    parser = DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", threads=1))
    try:
        scheduler = parser.engine.scheduler
        sampling = SamplingParams(max_new_tokens=12)
        broken = scheduler.submit(GenerationRequest(CROP, prompt_for("text"), sampling), start=False)
        fine = scheduler.submit(GenerationRequest(CROP, prompt_for("table"), sampling), start=False)

        def explode() -> None:
            raise RuntimeError("listener bug")

        seen: list[int] = []
        broken.on_token(explode)
        fine.on_token(lambda: seen.append(len(fine.tokens())))
        for _ in range(500):  # bounded: 12 tokens need far fewer steps
            if broken.done() and fine.done():
                break
            scheduler.step()
        failed, result = broken.result(timeout=0), fine.result(timeout=0)
        assert failed.finish_reason == "error" and "token listener failed: RuntimeError: listener bug" in failed.error
        assert result.finish_reason in ("stop", "length") and len(result.token_ids) > 1
        assert fine.tokens() == result.token_ids and seen == list(range(1, len(result.token_ids) + 1))
    finally:
        parser.close()


# -- admission: places, twins, orphans (deterministic: handles resolved by the test) -------------------


def test_admission_queues_beyond_its_places_joins_twins_and_cancels_only_orphans():
    async def scenario() -> None:
        admission = ChatAdmission(places=1, max_requests=3, orphan_grace=0.0, registry=CollectorRegistry())
        handles: dict[str, RequestHandle] = {}
        released: list[str] = []

        def runner(key: str):
            async def run(generation):
                handles[key] = RequestHandle(GenerationRequest(CROP, "", SamplingParams()))
                return handles[key]

            return run

        for _ in range(3):
            admission.enter()
        with pytest.raises(ApiError) as full:
            admission.enter()
        assert (full.value.status, full.value.code) == (429, "too_many_chat_requests")
        first = admission.start("a", 0, lambda: released.append("a"), runner("a"))
        second = admission.start("b", 0, lambda: released.append("b"), runner("b"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert list(handles) == ["a"]  # one place: b waits, nothing decoded for it
        twin = admission.join("a")
        assert twin is first and first.waiters == 2 and admission.joins._value.get() == 1
        assert admission.join("c") is None
        admission.leave(first)
        await asyncio.sleep(0.01)
        assert not handles["a"].cancel_requested  # a waiter is left: it runs on
        admission.leave(first)
        await asyncio.sleep(0.01)
        assert handles["a"].cancel_requested  # the last one gone: cancelled
        handles["a"].set_result(GenerationResult("", [], "cancelled"))
        await asyncio.wait_for(first.done.wait(), 10)
        assert released == ["a"] and "a" not in admission.generations
        for _ in range(20):
            await asyncio.sleep(0)
        assert "b" in handles  # the freed place went to b
        handles["b"].set_result(GenerationResult("x", [1], "stop"))
        await asyncio.wait_for(second.done.wait(), 10)
        assert second.result is not None and second.result.text == "x" and released == ["a", "b"]
        assert admission.started._value.get() == 2

    asyncio.run(scenario())


def test_orphans_are_dropped_while_queued_yield_to_waiting_requests_and_count_against_the_bound():
    """N8: a request whose client gave up must not delay one that waits. Its generation, queued, is
    dropped at once (its budget given back, nothing decoded); running, it runs on through the grace
    only while no generation with a waiter waits, for a place or for its first token (the engine's
    slots are fewer than the places), and it counts against ``max_requests`` until it has ended.
    (Orphans used to stay queued or running for the whole grace, counted nowhere.)"""

    async def scenario() -> None:
        registry = CollectorRegistry()
        admission = ChatAdmission(places=2, max_requests=3, orphan_grace=3600.0, registry=registry)
        handles: dict[str, RequestHandle] = {}
        released: list[str] = []

        def start(key: str):
            async def run(generation):
                handles[key] = RequestHandle(GenerationRequest(CROP, "", SamplingParams()))
                return handles[key]

            return admission.start(key, 0, lambda: released.append(key), run)

        def sample(name: str, **labels: str) -> float:
            return registry.get_sample_value(f"mineru_fast_chat_{name}", labels) or 0.0

        async def settle() -> None:
            for _ in range(20):
                await asyncio.sleep(0)

        async def end(generation, key: str) -> None:
            handles[key].set_result(GenerationResult("", [3], "cancelled"))
            await asyncio.wait_for(generation.done.wait(), 10)
            await settle()

        a, b, c = start("a"), start("b"), start("c")
        await settle()
        assert sorted(handles) == ["a", "b"] and sample("queued") == 1
        admission.leave(c)  # its client gave up while it waited for a place
        assert "c" not in admission.generations and sample("queued") == 0
        assert sample("orphans_cancelled_total", when="queued") == 1
        await asyncio.wait_for(c.done.wait(), 10)
        assert released == ["c"] and "c" not in handles  # its budget back, never decoded nor submitted
        handles["a"].push_token(5)
        handles["b"].push_token(5)
        await settle()
        admission.leave(a)  # nobody waits: it runs on through the grace
        await settle()
        assert not handles["a"].cancel_requested and sample("orphans") == 1
        admission.enter()
        admission.enter()
        with pytest.raises(ApiError) as full:  # two requests and the orphan make max_requests
            admission.enter()
        assert (full.value.status, full.value.code) == (429, "too_many_chat_requests")
        d = start("d")  # waits for a place: the orphan yields its own
        assert handles["a"].cancel_requested and sample("orphans_cancelled_total", when="yielded") == 1
        await settle()
        assert "d" not in handles  # the place is taken once the orphan has ended
        await end(a, "a")
        assert "d" in handles and sample("orphans") == 0
        admission.enter()  # the ended orphan no longer counts
        admission.leave(b)  # d waits for its first token: this orphan yields at once too
        assert handles["b"].cancel_requested and sample("orphans_cancelled_total", when="yielded") == 2
        await end(b, "b")
        handles["d"].set_result(GenerationResult("x", [1], "stop"))
        await asyncio.wait_for(d.done.wait(), 10)
        assert d.result is not None and d.result.text == "x" and released == ["c", "a", "b", "d"]
        assert sample("orphans_cancelled_total", when="grace") == 0 and admission.started._value.get() == 3

    asyncio.run(scenario())


# -- end to end on a real server ---------------------------------------------------------------------


KEYS = {"alice": "alice-secret-1", "bob": "bob-secret-22", "mallory": "mallory-secret-333"}
# A text answer of the tiny model loops (random weights), which the fast preset's loop guard ends after
# 512 tokens: about half a second here, less than a loaded lane may take between two steps of a test.
# The servers below whose answers must outlast a test turn the guard off and bound text answers at
# LONG tokens: tens of seconds of the tiny model's decoding, never reached in a test (the prompt
# and LONG stay within its 32,768 positions).
LONG = 30000
NO_LOOP_GUARD = ["--repetition-window", "0"]


def key_file(folder) -> str:
    path = folder / "keys.txt"
    path.write_text("".join(f"{name}:{secret}\n" for name, secret in KEYS.items()), encoding="utf-8")
    return str(path)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # One slot (two engine places): more requests than places queue. Text answers of random weights
    # run to their bound (the loop guard off), so a text request is long enough to disconnect from;
    # a keep-alive of 0.05 s makes every answer that waits at all a streamed one. API keys: twins
    # are shared within a key only.
    folder = tmp_path_factory.mktemp("chat_stream")
    args = ["--slots", "1", "--max-new-tokens", f"layout=24,text={LONG},table=24,equation=24", *NO_LOOP_GUARD]
    args += ["--chat-keepalive", "0.05", "--chat-orphan-grace", "0", "--api-key-file", key_file(folder)]
    with running_server(tiny_model, folder, *args) as s:
        yield s


def metrics(server) -> dict[str, float]:
    """The server's metric samples, keyed ``name{label="v",...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for_metric(server, name: str, value: float, bound_s: float = 120.0) -> None:
    deadline = time.monotonic() + bound_s
    while metrics(server).get(name) != value:
        assert time.monotonic() < deadline, f"{name} never became {value}: {metrics(server).get(name)}"
        time.sleep(0.1)


def post(server, body: dict, key: str = "alice") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth(key), timeout=300)


def stream(server, body: dict, key: str = "alice"):
    """``httpx.stream`` of a chat request with ``stream`` set (a context manager)."""
    url = f"{server.url}/v1/chat/completions"
    return httpx.stream("POST", url, json={**body, "stream": True}, headers=auth(key), timeout=300)


def first_token(response: httpx.Response) -> Iterator[str]:
    """Read a streamed answer up to its first token (its generation runs; the lines before are its
    role chunk and keep-alives). Returns its line iterator: a client that is to stay holds it, as
    httpx closes the connection once the iterator is dropped."""
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return lines
    raise AssertionError("the stream ended before a token came")


def test_the_loop_guard_is_a_serve_flag_and_off_a_looping_answer_runs_to_its_bound(server, tiny_model, tmp_path):
    """``--repetition-window 0`` (this module's server): the tiny model's looping text answer is not
    ended at the fast preset's 512-token window but runs to ``max_tokens``; a server with the
    preset's guard ends the same request at 512 tokens."""
    import argparse

    from mineru_fast.cli.options import add_options_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_options_arguments(p)
    assert options_from_args(p.parse_args([])).repetition_window == 512  # the fast preset's guard
    assert options_from_args(p.parse_args(["--repetition-window", "0"])).repetition_window == 0
    body = mineru_body(CROP, prompt_for("text"), max_tokens=700)
    answer = post(server, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 700
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    args = ["--slots", "1", "--max-new-tokens", "layout=24,text=700,table=24,equation=24", "--canary", "off"]
    with running_server(tiny_model, tmp_path, *args, "--api-key-file", key_file(tmp_path)) as guarded:
        answer = post(guarded, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 512  # the loop guard's window: ended as a loop


def test_a_streamed_answer_comes_in_token_chunks_that_join_to_the_answer(server):
    body = mineru_body(CROP, prompt_for("text"), max_tokens=12)
    # streamed first: the same request after it is answered from the finished-answer cache
    streamed = post(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    answer = post(server, body)
    assert answer.status_code == 200, answer.text
    expected = answer.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e for e in events[1:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(contents) > 1  # token by token, not one piece
    assert streamed_text(events) == expected
    finish = [e["choices"][0]["finish_reason"] for e in events[1:-1] if e["choices"]]
    assert finish[-1] == answer.json()["choices"][0]["finish_reason"] and set(finish[:-1]) == {None}
    assert events[-2]["choices"] == [] and events[-2]["usage"] == answer.json()["usage"]
    assert events[-1] == "[DONE]"
    stop = expected[3:5]  # the tiny model's newlines: a stop string two characters long
    cut = post(server, {**body, "stream": True, "stop": [stop]})
    assert streamed_text(sse_events(cut.text)) == expected[: expected.find(stop)]


def test_a_client_that_leaves_mid_stream_frees_its_request_and_generation(server):
    body = mineru_body(CROP, prompt_for("text"), max_tokens=LONG)  # still generating when the client leaves
    with stream(server, body) as response:
        first_token(response)
    wait_for_metric(server, "mineru_fast_chat_requests_in_flight", 0)
    wait_for_metric(server, "mineru_fast_chat_generations_in_flight", 0)
    assert metrics(server)['mineru_fast_chat_requests_total{status="499"}'] >= 1


def test_twins_sent_together_share_one_generation(server):
    """Four identical bodies at once: one generation, the others join it, all get its answer."""
    body = mineru_body(text_page(size=(300, 120), lines=2), prompt_for("text"), max_tokens=256)
    before = metrics(server)
    barrier = threading.Barrier(4)

    def send(_: int) -> httpx.Response:
        barrier.wait(timeout=60)
        return post(server, body)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
    after = metrics(server)
    started = after["mineru_fast_chat_generations_started_total"] - before["mineru_fast_chat_generations_started_total"]
    joins = after["mineru_fast_chat_twin_joins_total"] - before.get("mineru_fast_chat_twin_joins_total", 0)
    # a twin that came after the answer was done (a loaded machine) is answered from the cache
    cached = after.get("mineru_fast_chat_answer_cache_hits_total", 0) - before.get(
        "mineru_fast_chat_answer_cache_hits_total", 0
    )
    assert started == 1 and joins + cached == 3


def test_more_requests_than_engine_places_queue_and_are_all_answered(server):
    """Twelve different requests at once against one slot (two places): none refused, every answer
    valid JSON, those that waited sent early (chunked, keep-alive spaces before the JSON)."""
    bodies = [
        mineru_body(text_page(size=(200 + 8 * n, 90), lines=1), prompt_for("text"), max_tokens=6) for n in range(12)
    ]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda b: post(server, b), bodies))
    assert [a.status_code for a in answers] == [200] * 12
    assert all(a.json()["choices"][0]["finish_reason"] in ("stop", "length") for a in answers)
    assert any(a.headers.get("transfer-encoding") == "chunked" for a in answers)
    samples = metrics(server)
    assert not any('status="429"' in name for name in samples if name.startswith("mineru_fast_requests"))
    wait_for_metric(server, "mineru_fast_chat_generations_in_flight", 0)


def test_twins_are_shared_within_an_api_key_only(server):
    """The same body from two keys runs twice (it used to join the other key's generation, so one
    key's client was answered from another's); a re-send with the first key joins its own."""
    body = mineru_body(text_page(size=(260, 100), lines=2), prompt_for("text"), max_tokens=LONG)
    before = metrics(server)
    with contextlib.ExitStack() as streams:
        held = [first_token(streams.enter_context(stream(server, body, "alice")))]  # generating, LONG tokens
        for key in ("bob", "alice"):  # the role chunk comes once the request has been admitted
            held.append(streams.enter_context(stream(server, body, key)).iter_lines())
            assert next(held[-1]).startswith("data: {")
        after = metrics(server)
        del held
    started = after["mineru_fast_chat_generations_started_total"] - before["mineru_fast_chat_generations_started_total"]
    joins = after["mineru_fast_chat_twin_joins_total"] - before.get("mineru_fast_chat_twin_joins_total", 0)
    assert (started, joins) == (2, 1)
    wait_for_metric(server, "mineru_fast_chat_generations_in_flight", 0)


def test_orphans_of_a_key_whose_clients_gave_up_never_delay_another_keys_request(tiny_model, tmp_path):
    """N8 end to end, one slot (two places), a grace of 600 s. One key's two requests hold the
    places (one generating, one waiting for the slot) and four more wait for a place; then every
    client gives up. The four are dropped at once, the two run on as orphans, and another key's
    request makes both yield and is answered, where they would otherwise have run on for LONG tokens
    each before it."""
    args = ["--slots", "1", "--max-new-tokens", f"layout=24,text={LONG},table=24,equation=24", *NO_LOOP_GUARD]
    args += ["--chat-keepalive", "0.05", "--chat-orphan-grace", "600", "--api-key-file", key_file(tmp_path)]
    # the engine's one slot is this test's alone: the canary page, parsed after ready by default,
    # is other work the orphans may yield to (seen in a loaded lane: one orphan gone before bob came)
    args += ["--canary", "off"]
    page = text_page(size=(240, 90), lines=1)
    bodies = [mineru_body(page, f"{prompt_for('text')} {n}", max_tokens=LONG) for n in range(6)]
    with running_server(tiny_model, tmp_path, *args) as s:
        with stream(s, bodies[0], "mallory") as generating:
            held = [first_token(generating)]
            with stream(s, bodies[1], "mallory") as second:
                held.append(second.iter_lines())
                assert next(held[-1]).startswith("data: {")  # admitted: it has the other place
                with contextlib.ExitStack() as waiting:
                    queued = [waiting.enter_context(stream(s, body, "mallory")).iter_lines() for body in bodies[2:]]
                    assert all(next(lines).startswith("data: {") for lines in queued)
                    wait_for_metric(s, "mineru_fast_chat_queued", 4)
                    del queued
                wait_for_metric(s, "mineru_fast_chat_requests_in_flight", 2)  # the four clients are gone
                samples = metrics(s)
                assert (
                    samples["mineru_fast_chat_queued"] == 0 and samples["mineru_fast_chat_generations_in_flight"] == 2
                )
                assert samples['mineru_fast_chat_orphans_cancelled_total{when="queued"}'] == 4
                del held[1]
            wait_for_metric(s, "mineru_fast_chat_requests_in_flight", 1)
            del held
        wait_for_metric(s, "mineru_fast_chat_requests_in_flight", 0)
        samples = metrics(s)
        assert samples["mineru_fast_chat_orphans"] == 2 and samples["mineru_fast_chat_generations_in_flight"] == 2
        answer = post(s, mineru_body(CROP, prompt_for("text"), max_tokens=8), key="bob")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
        samples = metrics(s)
        assert samples['mineru_fast_chat_orphans_cancelled_total{when="yielded"}'] == 2
        assert samples["mineru_fast_chat_orphans"] == 0 and samples["mineru_fast_chat_generations_in_flight"] == 0
        assert samples['mineru_fast_chat_requests_total{status="499"}'] == 6
        assert samples['mineru_fast_chat_requests_total{status="200"}'] == 1
