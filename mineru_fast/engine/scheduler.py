"""The fast engine's scheduler: one loop per engine, fed by every caller, continuous batching.

Requests from any thread go into an inbox (their tokenization and image preprocessing run in the
submitting thread). The loop, on its own thread, repeats one *step*:

1. take new requests from the inbox; end cancelled requests and those past their deadline;
2. one decode step for every live sequence (one token each, all slots batched); live sequences
   are first moved down into slots freed below them (KV and decoding rules), so the step's width
   is the number of live sequences, not the highest slot a long one happened to take. A sequence
   with speculative decoding on (``GenerationRequest.speculative``) may add draft tokens as more
   rows of the step (``engine.speculative``; at most ``speculative_rows`` rows in all): its tokens
   are then chosen position by position, each with every decoding rule applied as in a plain step,
   and each next position's logits used only while the chosen token equals the draft token fed
   there. The output is the plain decode's (a row's logits do not depend on the other rows of a
   step); the cache positions of rejected drafts are written over by the next step;
3. admission work within ``admission_budget_s`` (at least one unit): a unit is either one
   batched prefill forward (chunks of waiting prompts, at most ``prefill_chunk_tokens`` tokens in
   all, each into its own slot) or one block of the vision encoder over the current pack of images
   (at most ``vision_pack_patches`` patches). After the first unit, the next one starts only if
   its estimated time (the rate measured on the last unit of its kind: seconds per patch of a
   vision block, per token of a prefill forward) still fits the budget. So a decode step waits
   for the budget or one unit, whichever is longer, however much work arrives (vLLM's chunked
   prefill, applied to vision too).

Prefill goes before vision (it puts sequences into the decode batch); vision runs ahead only while
fewer than ``slots`` sequences wait for a slot. Lower ``priority`` values are admitted first.

One request cannot break a step. ``submit`` validates it before it reaches the loop (prompt and
forced token ids within the vocabulary, exactly the image's pads, prompt + bound within a slot;
sampling values are checked by ``SamplingParams``). Failures stay with their sequence: a
per-sequence stage (prompt embeddings, decoding rules, the handle's token listeners) that raises
ends that sequence alone with an ``"error"`` result; a batched unit (a vision pack, a prefill
forward, a decode step) that raises is run again one sequence at a time, so only the sequences that
fail alone end with ``"error"`` and the others go on with the tokens they get alone. When the loop
goes idle (no work for a second) freed heap memory is returned to the OS (``memory.trim_heap``).

``max_decode_wait_s`` is the longest admission wait between two decode steps so far and
``max_decode_wait_cpu_s`` the loop thread's CPU seconds during that wait: a wait much longer than
its CPU time was spent off the CPU (other processes on the cores, another thread holding the GIL),
not on admission work.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mineru_fast.engine.base import FinishReason, GenerationRequest, GenerationResult, RequestHandle
from mineru_fast.engine.memory import trim_heap
from mineru_fast.engine.model import Qwen2LM
from mineru_fast.engine.preprocess import EncodedRequest, Preprocessor
from mineru_fast.engine.repetition import loop_period
from mineru_fast.engine.sampling import BatchLogitsProcessor, log_normalizer
from mineru_fast.engine.speculative import DraftProposer
from mineru_fast.options import check_speculative
from mineru_fast.protocol.spec import SamplingParams
from mineru_fast.runtime.threads import one_torch_thread

logger = logging.getLogger(__name__)

LOOP_STAGES = ("vision", "prefill", "decode_forward", "decode_other", "idle")
"""The engine loop's stages (``Scheduler.stage_s``): vision units (the encoder's steps, the pack's
pixels and outputs, the heap trim after a pass), prefill units (embedding, forward, the first
token's choice), each decode step's forward and the rest of the step (compaction, drafts, decoding
rules, log-probabilities, results; a failed step's forwards one by one), and waiting for work (with
the heap trim after a second of it). A step's rest is counted once its results are out: a reading
right after a request's result may miss the last step's rest (under a millisecond), which the next
reading then has."""


class ModelRunner(Protocol):
    """What the scheduler drives: the model side of one engine (``generate.FastEngine``).

    Attributes:
        preprocessor: the checkpoint's tokenizer and image processor.
        vocab_size: rows of the LM head (logits per token).
        lm: the language model (prefill and decode over the engine's KV cache).
    """

    preprocessor: Preprocessor
    vocab_size: int
    lm: Qwen2LM

    def vision_steps(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> Generator[None, None, torch.Tensor]:
        """The vision pass over a pack of images, one step per yield; returns ``[patches / 4, hidden]``."""
        ...

    def split_image_embeds(self, pack: list[SequenceState], embeds: torch.Tensor, elapsed: float) -> None:
        """Give each sequence of ``pack`` its rows of ``embeds`` and its share of ``elapsed`` seconds."""
        ...

    def start_prefill(self, seq: SequenceState) -> None:
        """Set ``seq``'s prompt embeddings and M-RoPE positions."""
        ...


__all__ = ["Scheduler", "SequenceState"]

REPETITION_CHECK_EVERY = 16  # tokens between two runs of the loop detector on a sequence


@dataclass(eq=False)
class SequenceState:
    """A request in flight.

    Attributes:
        index: submission number (the tie-break of equal priorities).
        embeds: prompt embeddings ``[L, hidden]`` (image tokens filled in) while it prefills.
        positions: M-RoPE positions ``[3, L]`` of the prompt.
        prefilled: prompt tokens already in the KV cache.
        rope_next: M-RoPE position of the next generated token.
    """

    index: int
    request: GenerationRequest
    encoded: EncodedRequest
    handle: RequestHandle | None = None
    image_embeds: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rope_next: int = 0
    vision_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ended: FinishReason | None = None  # set when cancelled / timed out outside the decode batch
    alone: bool = False  # its vision pack failed: it is encoded in a pack of its own
    proposer: DraftProposer | None = None  # speculative decoding on
    decode_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.request.priority, self.index)

    @property
    def prompt_len(self) -> int:
        return len(self.encoded.input_ids)


def _close_at_exit(ref: weakref.ref[Scheduler]) -> None:
    scheduler = ref()
    if scheduler is not None:
        scheduler.close(timeout=10)


def _patches(seq: SequenceState) -> int:
    """Patches of the sequence's image (its grid's ``t * h * w``: the pixel rows it came with)."""
    t, h, w = seq.encoded.grid_thw
    return t * h * w


def _no_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """A fresh ``[0, patch_dim]`` tensor to hold instead of ``pixels``: an empty view (``[:0]``)
    would keep the whole storage alive."""
    return pixels.new_empty((0, pixels.shape[1]))


def _chunk(seq: SequenceState, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The next ``n`` prompt tokens of ``seq`` as a ``Qwen2LM.prefill_chunks`` entry."""
    assert seq.embeds is not None and seq.positions is not None
    rows = slice(seq.prefilled, seq.prefilled + n)
    return seq.embeds[rows], seq.positions[:, rows], slot, seq.prefilled


class Scheduler:
    """Continuous batching over one ``ModelRunner`` (see the module docstring).

    Args:
        runner: the engine whose model, preprocessor and KV buffers this loop drives.
        slots: sequences decoded together (the KV buffers' batch width).
        max_seq_len: positions per slot; a request whose prompt plus ``max_new_tokens`` exceeds it
            is refused up front with an ``"error"`` result, so no output is ever cut by the buffer.
        admission_budget_s: seconds of prefill/vision work between two decode steps while
            sequences decode (at least one unit always runs).
        prefill_chunk_tokens: most prompt tokens in one prefill forward.
        vision_pack_patches: most patches in one vision pack (a layout image has 5476).
        repetition_window: loop guard window in tokens (0 disables; see ``repetition``); replayed
            sequences are never cut.
        speculative_rows: most rows of a decode step once draft tokens are added (live sequences
            first: a step of this many live sequences or more verifies no drafts, since a wide
            step's extra rows cost more than they save).
    """

    def __init__(
        self,
        runner: ModelRunner,
        slots: int,
        max_seq_len: int,
        admission_budget_s: float = 0.5,
        prefill_chunk_tokens: int = 512,
        vision_pack_patches: int = 8192,
        repetition_window: int = 0,
        speculative_rows: int = 8,
    ) -> None:
        self.runner = runner
        self.speculative_rows = speculative_rows
        self.draft_tokens = 0  # verified draft tokens, all sequences so far
        self.accepted_tokens = 0  # of them, the model's own choices
        self.slots, self.max_seq_len = slots, max_seq_len
        self.admission_budget_s = admission_budget_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.vision_pack_patches = vision_pack_patches
        self.repetition_window = repetition_window
        self.threads = torch.get_num_threads()  # the engine thread's intra-op threads: the builder's
        self.rules = BatchLogitsProcessor(
            [SamplingParams()] * slots, [None] * slots, runner.vocab_size, runner.preprocessor.end_ids
        )
        self.inbox: queue.SimpleQueue[SequenceState | None] = queue.SimpleQueue()
        self.waiting: list[SequenceState] = []  # need vision, in (priority, index) order
        self.vision_pack: list[SequenceState] = []
        self.vision_job: Generator[None, None, torch.Tensor] | None = None
        self.vision_job_s = 0.0
        self.ready: list[SequenceState] = []  # vision done, waiting for a slot
        self.prefilling: dict[int, SequenceState] = {}  # slot -> sequence part-way through its prompt
        self.live: dict[int, SequenceState] = {}  # slot -> decoding sequence
        self.max_decode_wait_s = 0.0  # longest admission work between two decode steps so far
        self.max_decode_wait_cpu_s = 0.0  # the loop thread's CPU seconds during that wait
        self.clock: Callable[[], float] = time.perf_counter  # budgets and timings (tests step a fake clock)
        # seconds per patch of the last vision block, per token of the last prefill forward
        self._rate: dict[str, float] = {}
        # where the loop's time went so far (``stage_seconds``), by the loop's clock
        self.stage_s = dict.fromkeys(LOOP_STAGES, 0.0)
        self._forward_s = 0.0  # the current decode step's forward
        self._idle_since: float | None = None  # when the loop began waiting for work, while it waits
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._closed = False

    # -- callers' side ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, start: bool = True) -> RequestHandle:
        """Encode ``request`` in this thread and queue it; never raises for a bad request.

        Args:
            start: start the loop thread if it is not running (False: the caller drives ``step``).
        """
        handle = RequestHandle(request)
        if self._closed:
            handle.set_result(GenerationResult("", [], "cancelled", error="the engine is closed"))
            return handle
        try:
            room = self.max_seq_len - request.sampling.max_new_tokens  # prompt tokens a slot can hold
            if room < 1:
                raise ValueError(
                    f"max_new_tokens {request.sampling.max_new_tokens} exceeds the KV buffer length {self.max_seq_len}"
                )
            with one_torch_thread():  # the engine thread alone runs multi-threaded ops (see threads)
                # the text is counted before the image is processed: an oversize prompt costs little
                encoded = self.runner.preprocessor.encode(request, max_prompt_tokens=room)
            needed = len(encoded.input_ids) + request.sampling.max_new_tokens
            if needed > self.max_seq_len:
                raise ValueError(
                    f"prompt of {len(encoded.input_ids)} tokens + max_new_tokens {request.sampling.max_new_tokens} "
                    f"exceeds the KV buffer length {self.max_seq_len}"
                )
            if "" in request.stop:
                raise ValueError("a stop string must not be empty")
            self._validate(encoded)
            proposer = self._proposer(request)
        except Exception as exc:  # a bad request fails alone, with its reason
            handle.set_result(GenerationResult.failed(exc))
            return handle
        self.inbox.put(SequenceState(next(self._counter), request, encoded, handle, proposer=proposer))
        if start:
            self._ensure_thread()
        return handle

    def _proposer(self, request: GenerationRequest) -> DraftProposer | None:
        """The request's draft proposer (None with speculative decoding off); its prompt text and
        ``draft_text`` tokenized here, in the submitting thread.

        Raises:
            ValueError: a ``speculative`` that is not an integer from 0 to
                ``options.MAX_SPECULATIVE`` (``options.check_speculative``).
        """
        check_speculative(request.speculative)
        if not request.speculative:
            return None
        pre = self.runner.preprocessor
        reference = pre.text_ids(request.draft_text) if request.draft_text else []
        return DraftProposer(pre.text_ids(request.prompt), reference, max_length=request.speculative)

    def _validate(self, encoded: EncodedRequest) -> None:
        """Refuse model inputs the loop's shared tensors cannot take (ValueError): token ids outside
        the vocabulary (prompt or forced), image pads that do not match the image's embeddings."""
        vocab = self.runner.vocab_size
        ids = encoded.input_ids
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if encoded.forced is not None and not all(0 <= t < vocab for t in encoded.forced):
            raise ValueError(f"forced token ids must be in 0..{vocab - 1}")
        t, h, w = encoded.grid_thw
        pads = int((ids == self.runner.preprocessor.image_token_id).sum())
        if pads != t * h * w // self.runner.preprocessor.merge_size**2:
            raise ValueError(f"the prompt has {pads} image pads for an image of {t}x{h}x{w} patches")

    def _ensure_thread(self) -> None:
        with self._thread_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="mineru-fast-engine", daemon=True)
                self._thread.start()
                # Stop the loop before the interpreter tears torch down under it (a daemon thread
                # left in the loop at exit can abort the process from C++ destructors).
                atexit.register(_close_at_exit, weakref.ref(self))

    def close(self, timeout: float | None = None) -> None:
        """Stop the loop; everything not finished ends with ``finish_reason="cancelled"``."""
        with self._thread_lock:
            self._closed = True
            thread = self._thread
        self.inbox.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._drain_inbox()
        for seq in self._all_sequences():
            self._end(seq, "cancelled")

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        untrimmed = False  # work was done since the heap was last trimmed
        with torch.inference_mode():
            while not self._closed:
                if not self.has_work():
                    self._idle_since = waited = self.clock()
                    try:
                        item = self.inbox.get(timeout=1.0)
                    except queue.Empty:  # idle for a second: give a burst's freed memory back
                        if untrimmed:
                            trim_heap()
                            untrimmed = False
                        continue
                    finally:  # stage_seconds counts a wait in progress itself: never both at once
                        self._idle_since = None
                        self.stage_s["idle"] += self.clock() - waited
                    if item is None:
                        break
                    self._admit(item)
                untrimmed = True
                try:
                    self.step()
                except Exception:  # a bug in the loop must not strand callers: fail what is in flight
                    logger.exception("engine step failed; ending the requests in flight")
                    for seq in self._all_sequences():
                        self._end(seq, "error", "the engine loop failed (see the log)")
                    self.vision_pack, self.vision_job = [], None

    def stage_seconds(self) -> dict[str, float]:
        """Seconds the loop spent per stage so far (``LOOP_STAGES``), a wait for work in progress
        included up to now: the difference of two calls is what happened between them."""
        stages = dict(self.stage_s)
        since = self._idle_since
        if since is not None:
            stages["idle"] += self.clock() - since
        return stages

    def has_work(self) -> bool:
        return bool(self.waiting or self.vision_pack or self.ready or self.prefilling or self.live)

    def step(self) -> bool:
        """One scheduler step (see the module docstring). Returns whether any work was done."""
        self._drain_inbox()
        self._expire()
        worked = False
        if self.live:
            self._decode_step()
            worked = True
        start, cpu_start = self.clock(), time.thread_time()
        had_live = bool(self.live)
        units = 0
        while (unit := self._next_unit()) is not None:
            if units and self.live and self.clock() - start + self._estimate(unit) > self.admission_budget_s:
                break
            began = self.clock()
            if unit == "vision":
                self._vision_unit()
            else:
                self._prefill_unit()
            self.stage_s[unit] += self.clock() - began
            worked, units = True, units + 1
        if had_live:
            wait = self.clock() - start
            if wait > self.max_decode_wait_s:
                self.max_decode_wait_s, self.max_decode_wait_cpu_s = wait, time.thread_time() - cpu_start
        return worked

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._admit(item)

    def _admit(self, seq: SequenceState) -> None:
        if self._closed:
            self._end(seq, "cancelled")
        else:
            bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def _all_sequences(self) -> list[SequenceState]:
        return [*self.waiting, *self.vision_pack, *self.ready, *self.prefilling.values(), *self.live.values()]

    def _expire(self) -> None:
        """End requests whose handle was cancelled or whose deadline passed, wherever they are."""
        now = time.monotonic()
        for seq in self._all_sequences():
            reason: FinishReason
            if seq.handle is not None and seq.handle.cancel_requested:
                reason = "cancelled"
            elif seq.request.deadline is not None and now >= seq.request.deadline:
                reason = "timeout"
            else:
                continue
            if seq in self.vision_pack:
                seq.ended = reason  # dropped when its pack completes
            else:
                self._end(seq, reason)

    # -- admission: prefill and vision ---------------------------------------------------------

    def _next_unit(self) -> str | None:
        """``"prefill"``, ``"vision"`` or None: the admission unit due next."""
        if self.prefilling or (self.ready and len(self.live) + len(self.prefilling) < self.slots):
            return "prefill"
        if self.vision_job is not None or (self.waiting and len(self.ready) < self.slots):
            return "vision"
        return None

    def _estimate(self, unit: str) -> float:
        """Seconds the next ``unit`` should take, at the rate of the last unit of its kind (0.0
        before the first one: it runs)."""
        rate = self._rate.get(unit, 0.0)
        if unit == "vision":
            return rate * self._pack_patches()
        free = self.slots - len(self.live) - len(self.prefilling)
        tokens = sum(s.prompt_len - s.prefilled for s in self.prefilling.values())
        tokens += sum(s.prompt_len for s in self.ready[: max(free, 0)])
        return rate * min(tokens, self.prefill_chunk_tokens)

    def _pack_patches(self) -> int:
        """Patches of the current vision pack, or of the one the next vision unit will form."""
        pack = self.vision_pack if self.vision_job is not None else self.waiting[: self._next_pack_size()]
        return sum(_patches(s) for s in pack)

    def _next_pack_size(self) -> int:
        """How many of ``waiting`` the next vision pack takes: in order, up to
        ``vision_pack_patches`` patches (at least one sequence); a sequence marked ``alone`` only
        in a pack of its own."""
        count = patches = 0
        for seq in self.waiting:
            n = _patches(seq)
            if count and (patches + n > self.vision_pack_patches or seq.alone or self.waiting[0].alone):
                break
            count, patches = count + 1, patches + n
        return count

    def _vision_unit(self) -> None:
        first = self.vision_job is None  # the patch embedding: no block, no rate
        start = self.clock()
        try:
            if self.vision_job is None:
                size = self._next_pack_size()
                self.vision_pack, self.waiting = self.waiting[:size], self.waiting[size:]
                self.vision_job_s = 0.0
                self.vision_job = self.runner.vision_steps(
                    self._pack_pixels(self.vision_pack), [s.encoded.grid_thw for s in self.vision_pack]
                )
            next(self.vision_job)
            elapsed = self.clock() - start
            self.vision_job_s += elapsed
            if not first:
                self._rate["vision"] = elapsed / max(1, self._pack_patches())
            return
        except StopIteration as stop:
            self.vision_job_s += self.clock() - start
            embeds: torch.Tensor = stop.value
            pack, self.vision_pack, self.vision_job = self.vision_pack, [], None
            try:
                self.runner.split_image_embeds(pack, embeds, self.vision_job_s)
            except Exception as exc:
                self._vision_failed(pack, exc)
                return
        except Exception as exc:
            pack, self.vision_pack, self.vision_job = self.vision_pack, [], None
            self._vision_failed(pack, exc)
            return
        for seq in pack:
            seq.encoded.pixel_values = _no_pixels(seq.encoded.pixel_values)  # no longer needed
            if seq.ended is not None:
                self._end(seq, seq.ended)
            else:
                bisect.insort(self.ready, seq, key=lambda s: s.order)

    @staticmethod
    def _pack_pixels(pack: list[SequenceState]) -> torch.Tensor:
        """The pack's pixels as one tensor. A pack of one image (a layout image: 26 MB) is not
        copied, and its sequence lets go of them now, so the vision pass frees them once they are
        embedded; a pack of several keeps each sequence's own, to encode them one by one should the
        pack fail (``_vision_failed``)."""
        if len(pack) > 1:
            return torch.cat([s.encoded.pixel_values for s in pack])
        encoded = pack[0].encoded
        pixels, encoded.pixel_values = encoded.pixel_values, _no_pixels(encoded.pixel_values)
        return pixels

    def _vision_failed(self, pack: list[SequenceState], exc: Exception) -> None:
        """A pack's vision pass raised: its one sequence ends with ``"error"``; a pack of several
        goes back to ``waiting``, each sequence to be encoded alone."""
        if len(pack) == 1:
            self._fail(pack[0], "vision", exc)
            return
        logger.warning("vision failed on a pack of %d images (%s); encoding them one by one", len(pack), exc)
        for seq in pack:
            if seq.ended is not None:
                self._end(seq, seq.ended)
            else:
                seq.alone = True
                bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def _prefill_unit(self) -> None:
        budget = self.prefill_chunk_tokens
        chunks: list[tuple[SequenceState, int, int]] = []  # (sequence, slot, tokens)
        for slot, seq in sorted(self.prefilling.items(), key=lambda item: item[1].order):
            if budget <= 0:
                break
            n = min(budget, seq.prompt_len - seq.prefilled)
            chunks.append((seq, slot, n))
            budget -= n
        free = [s for s in range(self.slots) if s not in self.live and s not in self.prefilling]
        while budget > 0 and self.ready and free:
            seq = self.ready.pop(0)
            try:
                self.runner.start_prefill(seq)
            except Exception as exc:
                self._fail(seq, "prefill", exc)
                continue
            slot = free.pop(0)
            self.prefilling[slot] = seq
            n = min(budget, seq.prompt_len)
            chunks.append((seq, slot, n))
            budget -= n
        if not chunks:
            return
        start = self.clock()
        try:
            rows = list(self.runner.lm.prefill_chunks([_chunk(seq, slot, n) for seq, slot, n in chunks]))
        except Exception as exc:
            if len(chunks) == 1:
                self._fail(chunks[0][0], "prefill", exc)
                return
            logger.warning("prefill failed for %d sequences (%s); running them one by one", len(chunks), exc)
            rows = [self._prefill_alone(seq, slot, n) for seq, slot, n in chunks]
        elapsed = self.clock() - start
        total = sum(n for _, _, n in chunks)
        self._rate["prefill"] = elapsed / max(1, total)
        completed: list[tuple[int, torch.Tensor]] = []  # (slot, logits of its first new token)
        for (seq, slot, n), row in zip(chunks, rows, strict=True):
            if row is None:  # failed alone: ended
                continue
            seq.prefilled += n
            seq.prefill_s += elapsed * n / total
            if seq.prefilled < seq.prompt_len:
                continue
            seq.embeds = seq.image_embeds = None
            try:
                self.rules.reset_row(slot, seq.request.sampling, seq.encoded.forced, seq.encoded.input_ids)
            except Exception as exc:
                self._fail(seq, "decoding rules", exc)  # ends it in its prefilling slot, which is released
                continue
            del self.prefilling[slot]
            self.live[slot] = seq
            completed.append((slot, row))
        if completed:
            self._choose([slot for slot, _ in completed], torch.stack([row for _, row in completed]))

    def _prefill_alone(self, seq: SequenceState, slot: int, n: int) -> torch.Tensor | None:
        """One sequence's chunk in a forward of its own (it writes only its own slot's positions,
        so running it again is harmless): the logits row, or None when it fails (then it is ended)."""
        try:
            return self.runner.lm.prefill_chunks([_chunk(seq, slot, n)])[0]
        except Exception as exc:
            self._fail(seq, "prefill", exc)
            return None

    # -- decode --------------------------------------------------------------------------------

    def _compact(self) -> None:
        """Move the sequence in the highest live slot into the lowest free slot below it, until
        there is none: a decode step runs every slot up to the highest live one, so a long
        sequence left high after the others ended would otherwise decode padding rows with it."""
        while self.live:
            top = max(self.live)
            free = next((s for s in range(top) if s not in self.live and s not in self.prefilling), None)
            if free is None:
                return
            seq = self.live.pop(top)
            self.runner.lm.move_slot(top, free, seq.prompt_len + len(seq.tokens) - 1)  # all but the last token
            self.runner.lm.release_slot(top)
            self.rules.move_row(top, free)
            self.live[free] = seq

    def _decode_inputs(
        self, rows: set[int], drafts: dict[int, list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token, M-RoPE position, cache position and slot ``[width + drafted]`` (int64) of a
        decode step over slots ``0..max(live)``, with the live sequences of ``rows`` decoding.
        Every other slot's row is padding that writes where its slot writes next: a prefilling
        slot's next chunk, a live slot's next token (one beyond this step's, which stays as it
        is). A live sequence never holds its whole slot (prompt + bound fits), so that position
        exists. Then the rows of ``drafts`` (slot -> draft tokens, slots in order): each draft
        token at the positions after its sequence's last token (``_drafts`` keeps them within
        the bound)."""
        width = max(self.live) + 1
        tokens = torch.zeros(width, dtype=torch.long)
        rope = torch.zeros(width, dtype=torch.long)
        cache = torch.zeros(width, dtype=torch.long)
        for slot in range(width):
            seq = self.live.get(slot)
            if seq is not None and slot in rows:
                tokens[slot] = seq.tokens[-1]
                rope[slot] = seq.rope_next - 1
                cache[slot] = seq.prompt_len + len(seq.tokens) - 1
            elif seq is not None:
                cache[slot] = seq.prompt_len + len(seq.tokens)
            elif slot in self.prefilling:
                cache[slot] = self.prefilling[slot].prefilled
        row_slots = torch.arange(width)
        if drafts:
            slots = sorted(drafts)
            ahead = torch.cat([torch.arange(1, len(drafts[s]) + 1) for s in slots])
            owners = torch.cat([torch.full((len(drafts[s]),), s) for s in slots])
            tokens = torch.cat([tokens, torch.tensor([t for s in slots for t in drafts[s]], dtype=torch.long)])
            rope = torch.cat([rope, rope[owners] + ahead])
            cache = torch.cat([cache, cache[owners] + ahead])
            row_slots = torch.cat([row_slots, owners])
        return tokens, rope, cache, row_slots

    def _drafts(self) -> dict[int, list[int]]:
        """Draft tokens of this step's speculating live sequences (slot -> tokens, none empty):
        each at most its request's ``speculative``, within its ``max_new_tokens`` (the last draft
        token's logits choose at most its last allowed token), and all within
        ``speculative_rows`` rows (padding rows of the slots below the highest live one count)."""
        room = self.speculative_rows - (max(self.live) + 1)
        drafts: dict[int, list[int]] = {}
        for slot, seq in sorted(self.live.items()):
            if seq.proposer is None:
                continue
            bound = seq.request.sampling.max_new_tokens - len(seq.tokens) - 1
            draft = seq.proposer.propose(seq.tokens, min(seq.request.speculative, bound, room))
            if draft:
                drafts[slot] = draft
                room -= len(draft)
        return drafts

    def _decode_step(self) -> None:
        start = self.clock()
        try:
            self._decode_rows()
        finally:
            self.stage_s["decode_other"] += self.clock() - start - self._forward_s

    def _decode_rows(self) -> None:
        """The decode step (``_decode_step`` times it): the forward of every live row and its
        drafts (``_forward_s`` its seconds), then each sequence's tokens chosen."""
        start = self.clock()
        self._forward_s = 0.0
        self._compact()
        drafts = self._drafts()
        try:
            inputs = self._decode_inputs(set(self.live), drafts)
            began = self.clock()
            logits = self.runner.lm.decode(*inputs)
            self._forward_s = self.clock() - began
            self.stage_s["decode_forward"] += self._forward_s  # before any result of the step is out
        except Exception as exc:
            if len(self.live) == 1:
                (seq,) = self.live.values()
                self._fail(seq, "decode", exc)
                return
            logger.warning("decode step failed for %d sequences (%s); running them one by one", len(self.live), exc)
            logits, drafts = self._decode_alone(), {}
        slots = sorted(self.live)
        if not slots:
            return
        share = (self.clock() - start) / len(slots)
        for slot in slots:
            self.live[slot].decode_s += share
            self.live[slot].decode_steps += 1
        drafted = {slot: (self.live[slot], len(self.live[slot].tokens)) for slot in drafts}
        for slot, draft in drafts.items():  # counted before a token can end the sequence (its result)
            self.live[slot].draft_tokens += len(draft)
            self.draft_tokens += len(draft)
        self._choose(slots, logits[slots], {slot: draft[0] for slot, draft in drafts.items()})
        if drafts:
            self._verify(drafts, drafted, logits, width=slots[-1] + 1)

    def _verify(
        self,
        drafts: dict[int, list[int]],
        drafted: dict[int, tuple[SequenceState, int]],
        logits: torch.Tensor,
        width: int,
    ) -> None:
        """Go on choosing the drafted sequences' tokens after the step's first ones: while the last
        token chosen equals the draft token fed at its position, that row's logits choose the next
        token (``_choose``, rules and all, counting it accepted when it equals the next draft
        token). ``drafted``: each slot's sequence and its token count when the step began (one that
        ended meanwhile stops; one whose token was not appended, its rules or listener having
        failed, accepts nothing more); ``logits``: the step's rows, drafts from ``width`` on in slot
        order (``_decode_inputs``)."""
        rows, first = {}, width
        for slot in sorted(drafts):
            rows[slot] = range(first, first + len(drafts[slot]))
            first += len(drafts[slot])
        accepted = dict.fromkeys(drafts, 0)
        for i in range(max(len(d) for d in drafts.values())):
            chosen = []
            for slot, draft in drafts.items():
                seq, before = drafted[slot]
                chose = accepted[slot] == i and len(seq.tokens) == before + i + 1  # this round's token is in
                if chose and i < len(draft) and seq.tokens[-1] == draft[i]:
                    accepted[slot] = i + 1
                    if self.live.get(slot) is seq:
                        chosen.append(slot)
            if not chosen:
                break
            expected = {slot: drafts[slot][i + 1] for slot in chosen if i + 1 < len(drafts[slot])}
            self._choose(chosen, logits[[rows[slot][i] for slot in chosen]], expected)
        for slot, draft in drafts.items():
            proposer = drafted[slot][0].proposer
            assert proposer is not None
            proposer.record(len(draft), accepted[slot])

    def _decode_alone(self) -> torch.Tensor:
        """The decode step run once per live sequence (the others padding, see ``_decode_inputs``):
        logits ``[width, vocab]`` with each sequence's row from its own run; a sequence whose run
        fails is ended."""
        rows: dict[int, torch.Tensor] = {}
        for slot, seq in sorted(self.live.items()):
            try:
                rows[slot] = self.runner.lm.decode(*self._decode_inputs({slot}))[slot]
            except Exception as exc:
                self._fail(seq, "decode", exc)
        if not rows:
            return torch.empty(0)
        logits = torch.zeros(max(rows) + 1, next(iter(rows.values())).shape[-1])
        for slot, row in rows.items():
            logits[slot] = row
        return logits

    def _choose(self, slots: list[int], logits: torch.Tensor, expected: dict[int, int] | None = None) -> None:
        """Pick each row's token (rules applied), record it with its log-probability, finish rows.
        ``expected``: slot -> the draft token at this position; a chosen token equal to it counts
        as accepted (before the token can end the sequence and publish its result).

        If the rules raise for the batch, each row is chosen alone: a row that fails alone ends
        its sequence with ``"error"``."""
        log_norm = log_normalizer(logits)
        try:
            chosen = self.rules(logits.clone(), rows=slots).argmax(dim=-1)
        except Exception as exc:
            if len(slots) == 1:
                self._fail(self.live[slots[0]], "decoding rules", exc)
                return
            for i, slot in enumerate(slots):
                self._choose([slot], logits[i : i + 1], expected)
            return
        logprobs = (logits.gather(1, chosen[:, None])[:, 0] - log_norm).tolist()
        for slot, token, logprob in zip(slots, chosen.tolist(), logprobs, strict=True):
            seq = self.live[slot]
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if expected and expected.get(slot) == token:
                seq.accepted_tokens += 1
                self.accepted_tokens += 1
            seq.rope_next += 1
            self.rules.observe([token], rows=[slot])
            if seq.handle is not None:
                try:
                    seq.handle.push_token(token)
                except Exception as exc:  # a caller's token listener: it ends its own request only
                    self._fail(seq, "token listener", exc)
                    continue
            reason = self._finish_reason(seq)
            if reason is not None:
                self._end(seq, reason)

    def _finish_reason(self, seq: SequenceState) -> FinishReason | None:
        if seq.tokens[-1] in self.runner.preprocessor.end_ids:
            return "stop"
        if seq.request.stop and self._holds_stop(seq):
            return "stop"
        if len(seq.tokens) >= seq.request.sampling.max_new_tokens:
            return "length"
        window = self.repetition_window
        if (
            window
            and seq.encoded.forced is None
            and len(seq.tokens) % REPETITION_CHECK_EVERY == 0
            and loop_period(seq.tokens, window) is not None
        ):
            return "repetition"
        return None

    def _holds_stop(self, seq: SequenceState) -> bool:
        """Whether the text of ``seq``'s last tokens holds one of its stop strings. Checked after
        every token, so a new stop string ends in the last one; every token is at least one byte
        and a character at most 4 (UTF-8), so ``4 * len(stop) + 1`` tokens cover it."""
        longest = max(len(s) for s in seq.request.stop)
        tail = self.runner.preprocessor.decode(seq.tokens[-(4 * longest + 1) :])
        return any(s in tail for s in seq.request.stop)

    # -- results -------------------------------------------------------------------------------

    def _fail(self, seq: SequenceState, stage: str, exc: Exception) -> None:
        """End ``seq`` alone with an ``"error"`` result for ``exc`` raised in ``stage``."""
        logger.error("%s failed for request %d", stage, seq.index, exc_info=exc)
        self._end(seq, "error", f"{stage} failed: {type(exc).__name__}: {exc}")

    def _end(self, seq: SequenceState, reason: FinishReason, error: str | None = None) -> None:
        """Publish ``seq``'s result and remove it from wherever it is."""
        for stage in (self.live, self.prefilling):
            for slot, other in list(stage.items()):
                if other is seq:
                    del stage[slot]
                    self.runner.lm.release_slot(slot)
        for stage_list in (self.waiting, self.ready):
            if seq in stage_list:
                stage_list.remove(seq)
        seq.embeds = seq.image_embeds = None
        result = GenerationResult(
            text=self.runner.preprocessor.decode(seq.tokens),
            token_ids=seq.tokens,
            finish_reason=reason,
            prompt_tokens=seq.prompt_len,
            vision_s=seq.vision_s,
            prefill_s=seq.prefill_s,
            decode_s=seq.decode_s,
            logprobs=seq.logprobs,
            error=error,
            decode_steps=seq.decode_steps,
            draft_tokens=seq.draft_tokens,
            accepted_tokens=seq.accepted_tokens,
        )
        if seq.handle is not None:
            seq.handle.set_result(result)
