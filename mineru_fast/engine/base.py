"""What every engine takes and returns: requests in, token sequences out, through handles.

An engine runs one long-lived loop per process. Any thread may ``submit`` a request and gets a
``RequestHandle`` at once (a future): the loop batches the requests of every caller together, and
a handle can be waited on, cancelled, or given a deadline. ``generate`` is the batch convenience
built on ``submit`` (used by tests and benchmarks).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from PIL import Image

from mineru_fast.protocol.spec import SYSTEM_PROMPT, SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # ParserOptions.precision -> torch dtype

FinishReason = Literal["stop", "length", "repetition", "cancelled", "timeout", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One image + task prompt to decode.

    Attributes:
        image: RGB input image (the 1036x1036 layout image or a block crop).
        prompt: the user turn's text, e.g. ``"\\nLayout Detection:"`` (see ``protocol.PROMPTS``).
        sampling: decoding rules (greedy; penalties; bounds).
        forced_text: replay: the exact output to produce. The engine then chooses these tokens
            (followed by ``<|im_end|>``) instead of its argmax, while computing every forward pass
            and logits step in full, so time and memory equal the real model producing it.
        system: the system turn; ``""`` or None means Qwen2-VL's default (``SYSTEM_PROMPT``), as
            the model's chat template renders a conversation without one.
        text_before_image: the user turn puts the text before the image (image first by default,
            as MinerU's clients send it).
        deadline: ``time.monotonic()`` second after which the request is ended with
            ``finish_reason="timeout"`` (its tokens so far are kept); None = no deadline.
        priority: lower values are admitted first among waiting requests (vLLM's convention);
            equal priorities keep submission order.
        stop: strings that end the output when it comes to hold one (``finish_reason="stop"``;
            the text is kept whole, stop string included: cutting it is the caller's choice).
        speculative: most draft tokens a decode step verifies for this request: an integer from
            0 (off) to ``options.MAX_SPECULATIVE`` (speculative decoding, module
            ``mineru_fast.engine.speculative``; the output is the same either way). The fast
            engine drafts; the reference engine decodes plainly (its results count no drafts).
        draft_text: text the output is expected to hold (the PDF text layer of the block a crop
            shows), a source of drafts when ``speculative`` is on; None = none.
    """

    image: Image.Image
    prompt: str
    sampling: SamplingParams
    forced_text: str | None = None
    system: str | None = SYSTEM_PROMPT
    text_before_image: bool = False
    deadline: float | None = None
    priority: int = 0
    stop: tuple[str, ...] = ()
    speculative: int = 0
    draft_text: str | None = None


@dataclass
class GenerationResult:
    """Output of one request.

    Attributes:
        text: decoded output, special tokens kept, end token removed.
        token_ids: generated token ids, end token included when generated.
        finish_reason: ``"stop"`` (end token), ``"length"`` (``max_new_tokens`` reached),
            ``"repetition"`` (ended by the repetition guard), ``"cancelled"`` (its handle was
            cancelled), ``"timeout"`` (its deadline passed) or ``"error"``.
        prompt_tokens: prompt length in tokens, image tokens included.
        vision_s / prefill_s / decode_s: seconds in the vision encoder, in the rest of the
            prefill, and in decode steps (logits processing included); a request's share of a
            batched step is the step time divided by the rows in it.
        logprobs: natural-log probability of each generated token under the model's own
            distribution (softmax of the raw logits, before penalties, bans or forcing), one per
            ``token_ids`` entry. In replay these are the forced tokens' log-probabilities.
        error: the message when ``finish_reason == "error"``.
        decode_steps: decode steps the sequence took part in (without speculative decoding, one
            per generated token after the first, which its prefill gives).
        draft_tokens / accepted_tokens: draft tokens verified for it, and how many of them were
            the model's own choices (speculative decoding; 0 when off).
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    vision_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logprobs: list[float] | None = None
    error: str | None = None
    decode_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def failed(cls, exc: BaseException | str) -> GenerationResult:
        """An ``"error"`` result carrying ``exc`` as ``"TypeName: message"``."""
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        return cls("", [], "error", error=message)


class RequestHandle:
    """A submitted request: wait for its result, cancel it, or look at its state.

    The engine never raises through a handle: every outcome, errors included, is a
    ``GenerationResult``. ``cancel()`` asks the engine loop to end the request at its next step
    (tokens so far are kept, ``finish_reason="cancelled"``); it returns at once.

    Tokens as they come: an engine that reports them (the fast engine's scheduler) calls
    ``push_token`` for each generated token; ``tokens()`` is what came so far and a listener added
    with ``on_token`` is called (in the engine's thread, so it must be quick: e.g. wake an event
    loop) after each. A listener that raises ends this request alone (the engine catches it).
    """

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self._cancelled = threading.Event()
        self._tokens: list[int] = []
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the result is ready.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the request keeps running).
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled.is_set()

    @property
    def future(self) -> concurrent.futures.Future[GenerationResult]:
        """The underlying future (for ``concurrent.futures.wait`` and callbacks)."""
        return self._future

    def set_result(self, result: GenerationResult) -> None:
        """Engine side: publish the outcome (first call wins)."""
        if not self._future.done():
            self._future.set_result(result)

    def tokens(self) -> list[int]:
        """The tokens generated so far, as pushed by the engine (a copy; empty for an engine that
        does not report tokens as they come: then only the result has them)."""
        with self._lock:
            return list(self._tokens)

    def on_token(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each token the engine pushes from now on (tokens that came
        before are in ``tokens()``; the result's future tells when there will be no more)."""
        with self._lock:
            self._listeners.append(listener)

    def push_token(self, token: int) -> None:
        """Engine side: record one generated token and call the listeners.

        Raises:
            Exception: whatever a listener raised (the engine ends this request with it).
        """
        with self._lock:
            self._tokens.append(token)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


FollowUp = Callable[[int, GenerationResult], Sequence[GenerationRequest]]
"""``on_result(index, result) -> follow-up requests``: called in the caller's thread as each
request finishes (errors included); the requests it returns are submitted at once and take the
next free indices, in the order returned."""


def generate_with_follow_ups(
    submit: Callable[[GenerationRequest], RequestHandle],
    requests: Sequence[GenerationRequest],
    on_result: FollowUp | None = None,
) -> list[GenerationResult]:
    """``Engine.generate`` on top of ``submit``: submit everything, call ``on_result`` as results
    arrive (in this thread), submit its follow-ups, return all results in index order."""
    handles = [submit(r) for r in requests]
    results: dict[int, GenerationResult] = {}
    index_of = {h.future: i for i, h in enumerate(handles)}
    waiting = set(index_of)
    while waiting:
        done, waiting = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in sorted(done, key=index_of.__getitem__):
            index = index_of[future]
            results[index] = future.result()
            if on_result is None:
                continue
            for follow_up in on_result(index, results[index]) or ():
                handle = submit(follow_up)
                index_of[handle.future] = len(handles)
                handles.append(handle)
                waiting.add(handle.future)
    return [results[i] for i in range(len(handles))]
