"""Hostile and damaged inputs through ``DocumentParser`` (tiny model): typed errors, page results, no escape.

The fuzz test here is the suite's short, deterministic run; ``benchmarks/fuzz_inputs.py`` is the
long one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CORPUS
from fuzzing import check_parse, corpus_seeds, made_seeds, mutate
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from PIL import Image
from samples import image_bytes, pdf_bytes, sample_trace, text_page, tiff_with_frame_size

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.errors import InputError
from mineru_fast.inputs.documents import open_document

# Random weights never emit a valid layout, so bounded steps keep each page short.
BOUNDS = {"layout": 8, "text": 8, "table": 8, "equation": 8}


@pytest.fixture(scope="module")
def parser(tiny_model):
    return DocumentParser.from_pretrained(
        tiny_model, ParserOptions.preset("exact", max_new_tokens=BOUNDS, max_side=1024)
    )


@pytest.fixture(scope="module")
def replay_parser(tiny_model):
    """Without the short bounds: a replayed output runs to its end (bounds apply to replay too)."""
    return DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", max_side=1024))


@pytest.mark.slow
def test_an_oversized_tiff_frame_fails_alone_and_the_next_input_goes_on(replay_parser):
    """A 20000x20000 second frame (a few KB of file) raised Pillow's DecompressionBombError out of
    ``parse`` and ``parse_many``: page 1 was lost and the next input never parsed."""
    frames = [text_page(size=(300, 400)), Image.new("1", (64, 64), 1)]
    bomb = tiff_with_frame_size(frames, 1, (20000, 20000), compression="tiff_deflate")
    assert len(bomb) < 50_000
    document = replay_parser.parse(bomb, replay=sample_trace(2))  # replayed: page 1 is a clean success
    first, second = document.pages
    assert (first.status, first.size) == ("success", (300, 400))
    assert second.status == "failure" and (second.errors[0].code, second.errors[0].page) == ("image_too_large", 1)
    assert second.errors[0].message.startswith("document: frame 2 is 20000x20000")
    assert document.status == "partial"

    good = image_bytes(text_page(size=(200, 260)), "PNG")
    documents = list(replay_parser.parse_many([bomb, b"not a document at all", good], replay=sample_trace(2)))
    assert [d.status for d in documents] == ["partial", "failure", "success"]
    assert documents[1].errors[0].code == "unsupported_format"
    assert documents[2].pages[0].size == (200, 260)


_SEEDS = {**made_seeds(), **corpus_seeds(CORPUS, max_bytes=1_500_000, max_pages=3)}
_FUZZ = {
    "deadline": None,  # a hang is caught by the suite's timeout, not by a speed assumption
    "derandomize": True,  # the same inputs on every run
    "database": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the damage it skips
@settings(max_examples=600, **_FUZZ)
@given(rng=st.randoms(use_true_random=False))
def test_fuzzed_documents_open_and_render_or_fail_with_a_typed_error(rng):
    """The input layer alone (no model), many inputs: Pillow raised TypeError, SyntaxError, ... here."""
    description, data = mutate(_SEEDS, rng)
    note(description)
    try:
        with open_document(data, max_side=1024) as opened:
            for index in opened.page_indices:
                try:
                    assert opened.render(index).mode == "RGB"
                except InputError:
                    pass
    except InputError:
        pass


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=40, **_FUZZ)
@given(rng=st.randoms(use_true_random=False))
def test_fuzzed_documents_parse_or_fail_with_a_typed_error(parser, rng):
    description, data = mutate(_SEEDS, rng)
    note(description)
    check_parse(parser, data)


RENDER_BOMB_LINES = 1_000_000  # minutes for PDFium at 200 DPI (4.4 s per 20,000 lines here); a 64 KB file


@pytest.mark.slow
def test_a_render_bomb_page_fails_alone_within_the_render_timeout(tiny_model):
    """A 13.6 KB PDF of 300,000 stroked lines rendered for 133 s, unbounded."""
    import multiprocessing

    from samples import stroked_lines_pdf

    bomb = stroked_lines_pdf([RENDER_BOMB_LINES, 10])
    assert len(bomb) < 100_000
    options = ParserOptions.preset("exact", max_side=1024, render_timeout=1.0)  # unbounded: replayed in full
    parser = DocumentParser.from_pretrained(tiny_model, options)
    document = parser.parse(bomb, replay=sample_trace(2))
    first, second = document.pages
    assert first.status == "failure" and first.errors[0].code == "render_timeout"
    assert first.errors[0].message == "document: page 1 took longer than 1 s to render (render_timeout option)"
    assert (second.status, second.size) == ("success", (792, 1024))  # the next page: a fresh process
    assert document.status == "partial"
    assert not multiprocessing.active_children()  # the render processes were stopped, the killed one too


@pytest.mark.slow
def test_a_long_render_does_not_hold_the_pdfium_lock(tmp_path):
    """While the bomb rendered, the process-wide PDFium lock was held: another client's 2-page PDF
    waited 137 s."""
    import threading

    from samples import pdf_bytes, stroked_lines_pdf

    from mineru_fast.errors import RenderTimeout

    outcome: list[BaseException] = []

    def render_bomb() -> None:
        with open_document(stroked_lines_pdf([RENDER_BOMB_LINES]), render_timeout=10.0) as opened:
            try:
                opened.render(0)
            except RenderTimeout as exc:
                outcome.append(exc)

    bomb = threading.Thread(target=render_bomb)
    bomb.start()
    try:
        with open_document(pdf_bytes(2)) as opened:  # in this process: it needs the lock
            sizes = [opened.render(i).size for i in opened.page_indices]
        assert bomb.is_alive()  # the other page came out while the bomb was still rendering
    finally:
        bomb.join(60)
    assert sizes == [(1700, 2200)] * 2
    assert len(outcome) == 1 and "took longer than 10 s" in str(outcome[0])


@pytest.mark.slow
def test_a_render_process_that_dies_fails_its_page_and_the_next_page_gets_a_new_one():
    """A render process killed (a PDFium crash, the OOM killer) fails the page it was on; the pages
    after it render in a fresh process instead of all failing with it."""
    import os
    import signal

    from mineru_fast.errors import CorruptDocument

    with open_document(pdf_bytes(3), render_timeout=60.0) as opened:
        first = opened.render(0)
        os.kill(opened._renderer._process.pid, signal.SIGKILL)
        opened._renderer._process.join(10)
        with pytest.raises(CorruptDocument, match="page 2: the render process ended"):
            opened.render(1)
        assert opened.render(2).size == first.size


def test_a_document_of_slow_pages_holds_its_worker_for_two_render_timeouts_only():
    """Audit round 4, N2: a small PDF whose pages share one slow content stream held the only
    worker for every page's ``render_timeout`` in turn (20 pages x 3 s: 67 s; on 44d1b50 each of
    these pages was rendered until it timed out). After two time-outs its other pages fail at
    once, each with its own ``render_timeout`` error, and no render process is started for them."""
    from samples import stroked_lines_pdf

    from mineru_fast.errors import RenderTimeout
    from mineru_fast.inputs.documents import MAX_RENDER_TIMEOUTS

    with open_document(stroked_lines_pdf([RENDER_BOMB_LINES] * 6), render_timeout=0.5) as opened:
        messages = []
        for index in opened.page_indices:
            with pytest.raises(RenderTimeout) as info:
                opened.render(index)
            messages.append(str(info.value))
            assert opened._renderer is None  # killed, or never started
    assert MAX_RENDER_TIMEOUTS == 2
    timed_out = "took longer than 0.5 s to render (render_timeout option)"
    assert messages[:2] == [f"document: page {i} {timed_out}" for i in (1, 2)]
    assert messages[2:] == [
        f"document: page {i} not rendered: 2 pages of this document took longer than 0.5 s to render already "
        "(render_timeout option)"
        for i in range(3, 7)
    ]


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    try:
        return _stat_fields(pid)[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, ... (``man 5 proc``, from field 3)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _until(condition, timeout: float) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; whether it held."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_the_render_process_ends_with_the_process_that_started_it(tmp_path):
    """Audit round 4, N10: after ``kill -9`` of ``serve``, its render process went on rendering its
    page at 74-90 % CPU, and the forkserver stayed up with it (it lives while any process it
    forked does). Both now end with the process that asked for the render, mid-page."""
    import os
    import signal
    import subprocess
    import sys

    from samples import stroked_lines_pdf

    bomb = tmp_path / "bomb.pdf"
    bomb.write_bytes(stroked_lines_pdf([RENDER_BOMB_LINES]))  # minutes of rendering
    script = (
        "import threading\n"
        "from mineru_fast.inputs.documents import open_document\n"
        f"opened = open_document({str(bomb)!r}, render_timeout=600.0)\n"
        "threading.Thread(target=opened.render, args=(0,), daemon=True).start()\n"
        "while opened._renderer is None or opened._renderer._process.pid is None:\n"
        "    threading.Event().wait(0.01)\n"
        "print(opened._renderer._process.pid, flush=True)\n"
        "threading.Event().wait()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = forkserver = None
    try:
        child = int(server.stdout.readline())
        forkserver = int(_stat_fields(child)[1])  # the render process's parent
        assert forkserver != server.pid
        ticks = os.sysconf("SC_CLK_TCK")
        # Rendering: 0.3 s of CPU spent (opening the 64 KB file takes milliseconds).
        assert _until(lambda: sum(map(int, _stat_fields(child)[11:13])) >= 0.3 * ticks, 60)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        assert _until(lambda: not _running(child), 30), "the render process outlived its parent"
        assert _until(lambda: not _running(forkserver), 30), "the forkserver outlived its parent"
    finally:
        server.kill()
        server.wait(10)
        for pid in (child, forkserver):
            if pid is not None and _running(pid):
                os.kill(pid, signal.SIGKILL)
