"""How chat completions reach the engine: a queue bounded by memory, and twins sharing one generation.

A batch client (MinerU's ``http-client``: 100 requests at once by default, retried on ``429``,
``5xx`` and timeouts) sends more requests than the engine has slots. Here each request is first
*admitted*: its memory (the image's decode peak and the model's input for it, estimated from the
image's headers) is reserved in the service's decode budget, or it is refused ``429`` with
``Retry-After`` when the budget cannot hold it. An admitted request waits for one of ``places``
engine places (lower ``priority`` first, then arrival order) and only then has its image decoded
and submitted, so a queue of requests holds their bodies and reservations, not decoded pixels.

Requests of one API key whose generation-defining inputs are equal (``ChatPlan.key``: the image
bytes, prompts, sampling, bounds, stop strings) while one of them is queued or running are *twins*:
the later ones join the first one's ``ChatGeneration`` instead of decoding it again (a client's
re-send after a timeout, the same crop twice in a document), and every waiter gets the same tokens.
A generation whose last waiter has gone is an *orphan*: dropped at once while it still waits for a
place; once it has one, it keeps running for ``orphan_grace`` seconds (time for a re-send to join
it) only while no generation with a waiter waits (for a place, or for its first token: the
engine's slots are fewer than the places), and it counts against ``max_requests`` until it has
ended. Orphans therefore run on idle capacity only, and at most one per place. Once a generation
has finished, a twin that comes later is answered from the ``AnswerCache`` (bounded in entries and
bytes) with the same result, without decoding again.

Everything here runs on the event loop's thread; the engine's thread only calls the token waker,
through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from mineru_fast.engine.base import GenerationResult, RequestHandle
from mineru_fast.serve.answer_cache import AnswerCache
from mineru_fast.serve.errors import ApiError

logger = logging.getLogger(__name__)

__all__ = ["ChatAdmission", "ChatGeneration"]

Runner = Callable[["ChatGeneration"], Awaitable[RequestHandle | None]]
"""Decodes a generation's image and submits it to the engine once it has a place; returns the
engine's handle (None when the generation was cancelled meanwhile). Raises ``ApiError``."""


@dataclass(eq=False)
class ChatGeneration:
    """One engine generation and the chat requests waiting for it.

    Attributes:
        key: the twin key (the API key's name and ``ChatPlan.key``).
        priority: the first request's priority (lower first).
        release: gives back the generation's budget reservation (called once, when it ends).
        waiters: requests waiting for it now.
        handle: the engine's handle once submitted.
        result: the engine's result once done (None on ``error``).
        error: why it ended without a result.
        done: set when it ended (``result`` or ``error`` set).
        generating: the engine has reported a token (or it ended).
    """

    key: str
    priority: int
    release: Callable[[], None]
    waiters: int = 0
    handle: RequestHandle | None = None
    result: GenerationResult | None = None
    error: ApiError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    generating: bool = False
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    wakers: set[asyncio.Event] = field(default_factory=set)
    _wake_pending: bool = False

    def wake(self) -> None:
        """Tell every streaming waiter that tokens came (or the generation ended)."""
        self._wake_pending = False
        self.generating = True
        for waker in self.wakers:
            waker.set()

    def waker(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """The engine-thread side of ``wake``: one call scheduled on ``loop`` at a time."""

        def from_engine() -> None:
            if not self._wake_pending:
                self._wake_pending = True
                loop.call_soon_threadsafe(self.wake)

        return from_engine

    def cancel(self) -> None:
        """End the generation: at once while it waits for a place, at the engine's next step once submitted."""
        self.cancelled = True
        self.placed.set()  # a queued one stops waiting
        if self.handle is not None:
            self.handle.cancel()


class ChatAdmission:
    """The chat door's requests, places and twins (see the module docstring).

    Args:
        places: generations in the engine at once (submitted, not yet finished).
        max_requests: chat requests in flight at once (waiting or answered) plus orphans still
            running, an outer bound; beyond it ``429 too_many_chat_requests``.
        orphan_grace: seconds a running generation without waiters keeps running before it is
            cancelled (sooner when a generation with a waiter waits).
        registry: where the door's metrics go.
        answers: finished answers kept for later twins (default: ``AnswerCache()``'s bounds).
    """

    def __init__(
        self,
        places: int,
        max_requests: int,
        orphan_grace: float,
        registry: CollectorRegistry,
        answers: AnswerCache | None = None,
    ) -> None:
        self.places, self.max_requests, self.orphan_grace = places, max_requests, orphan_grace
        self.answers = AnswerCache() if answers is None else answers
        self.in_flight = 0  # requests
        self._holders: set[ChatGeneration] = set()  # generations holding a place
        self._orphans: set[ChatGeneration] = set()  # holders without waiters, until they end
        self.generations: dict[str, ChatGeneration] = {}  # queued or running, by key
        self._queue: list[tuple[int, int, ChatGeneration]] = []
        self._order = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        r = registry
        Gauge("mineru_fast_chat_requests_in_flight", "Chat completions in flight", registry=r).set_function(
            lambda: float(self.in_flight)
        )
        Gauge("mineru_fast_chat_generations_in_flight", "Chat generations queued or running", registry=r).set_function(
            lambda: float(len(self.generations))
        )
        Gauge("mineru_fast_chat_queued", "Chat generations waiting for an engine place", registry=r).set_function(
            lambda: float(len(self._queue))
        )
        Gauge("mineru_fast_chat_orphans", "Chat generations running with no request waiting", registry=r).set_function(
            lambda: float(len(self._orphans))
        )
        self.outcomes = Counter(
            "mineru_fast_chat_requests", "Chat completions by the status they were answered", ["status"], registry=r
        )
        self.started = Counter("mineru_fast_chat_generations_started", "Chat generations submitted", registry=r)
        self.joins = Counter("mineru_fast_chat_twin_joins", "Chat requests that joined a running twin", registry=r)
        self.answer_hits = Counter(
            "mineru_fast_chat_answer_cache_hits", "Chat requests answered from the finished-answer cache", registry=r
        )
        Gauge("mineru_fast_chat_answer_cache_entries", "Answers the cache keeps", registry=r).set_function(
            lambda: float(len(self.answers))
        )
        Gauge("mineru_fast_chat_answer_cache_bytes", "Bytes of the answers the cache keeps", registry=r).set_function(
            lambda: float(self.answers.bytes)
        )
        self.orphans_cancelled = Counter(
            "mineru_fast_chat_orphans_cancelled",
            "Chat generations cancelled once no request waited, by when: queued (at once), "
            "yielded (a generation with a waiter waited), grace (orphan_grace passed)",
            ["when"],
            registry=r,
        )

    # -- requests --------------------------------------------------------------------------------

    def enter(self) -> None:
        """Count a request in.

        Raises:
            ApiError: 429 ``too_many_chat_requests`` once the requests in flight and the orphans
                still running number ``max_requests``.
        """
        if self.in_flight + len(self._orphans) >= self.max_requests:
            raise ApiError(429, "too_many_chat_requests", "too many chat requests in flight", {"Retry-After": "1"})
        self.in_flight += 1

    def exit(self, status: int) -> None:
        """Count a request out, with the status it was answered (once per ``enter``)."""
        self.in_flight -= 1
        self.outcomes.labels(status=str(status)).inc()

    # -- generations -----------------------------------------------------------------------------

    def join(self, key: str) -> ChatGeneration | None:
        """The queued or running generation of ``key``, now with one waiter more, or an ended one
        holding the cached answer of ``key``; None when neither."""
        generation = self.generations.get(key)
        if generation is None or generation.cancelled:
            answer = self.answers.get(key)
            if answer is None:
                return None
            self.answer_hits.inc()
            generation = ChatGeneration(key, 0, lambda: None, waiters=1, result=answer, generating=True)
            generation.placed.set()
            generation.done.set()
            return generation
        generation.waiters += 1
        self._orphans.discard(generation)
        self.joins.inc()
        return generation

    def start(self, key: str, priority: int, release: Callable[[], None], run: Runner) -> ChatGeneration:
        """A new generation of ``key`` with one waiter: queued for a place, then ``run``."""
        generation = ChatGeneration(key, priority, release, waiters=1)
        self.generations[key] = generation
        heapq.heappush(self._queue, (generation.priority, next(self._order), generation))
        self._grant()
        task = asyncio.get_running_loop().create_task(self._run(generation, run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return generation

    def leave(self, generation: ChatGeneration) -> None:
        """One waiter less. The last one gone, a queued generation is dropped at once; a running one
        is cancelled after ``orphan_grace`` seconds unless a twin joined meanwhile, or as soon as a
        generation with a waiter waits."""
        generation.waiters -= 1
        if generation.waiters > 0 or generation.done.is_set():
            return
        if not generation.placed.is_set():
            self._queue = [entry for entry in self._queue if entry[2] is not generation]
            heapq.heapify(self._queue)
            self._cancel_orphan(generation, "queued")
            return
        self._orphans.add(generation)
        self._grant()

        def cancel_if_orphaned() -> None:
            if generation.waiters == 0 and not generation.done.is_set() and not generation.cancelled:
                self._cancel_orphan(generation, "grace")

        asyncio.get_running_loop().call_later(self.orphan_grace, cancel_if_orphaned)

    def _cancel_orphan(self, generation: ChatGeneration, when: str) -> None:
        generation.cancel()
        self.orphans_cancelled.labels(when=when).inc()
        if self.generations.get(generation.key) is generation:
            del self.generations[generation.key]

    async def _run(self, generation: ChatGeneration, run: Runner) -> None:
        try:
            await generation.placed.wait()
            handle = None if generation.cancelled else await run(generation)
            if handle is None:
                raise ApiError(503, "request_ended", "the request ended early: cancelled")
            self.started.inc()
            generation.handle = handle
            handle.on_token(generation.waker(asyncio.get_running_loop()))
            if generation.cancelled:
                handle.cancel()
            generation.result = await asyncio.wrap_future(handle.future)
            self.answers.put(generation.key, generation.result)
        except ApiError as exc:
            generation.error = exc
        except Exception:
            logger.exception("chat generation failed")
            generation.error = ApiError(500, "internal_error", "the server failed to run the request; see its logs")
        finally:
            self._orphans.discard(generation)
            if generation in self._holders:
                self._holders.discard(generation)
                self._grant()
            generation.release()
            if self.generations.get(generation.key) is generation:
                del self.generations[generation.key]
            generation.done.set()
            generation.wake()

    def _grant(self) -> None:
        """Give free places to the queue's first generations. While a generation with a waiter
        waits, for a place or for its first token, running orphans yield (cancelled: their places
        and engine slots are taken once they have ended)."""
        while self._queue and len(self._holders) < self.places:
            _, _, generation = heapq.heappop(self._queue)
            self._holders.add(generation)
            generation.placed.set()
        if self._queue or any(holder.waiters and not holder.generating for holder in self._holders):
            for orphan in [orphan for orphan in self._orphans if not orphan.cancelled]:
                self._cancel_orphan(orphan, "yielded")
