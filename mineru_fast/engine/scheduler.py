"""The fast engine's scheduler: one loop per engine, fed by every caller, continuous batching.

Requests from any thread go into an inbox (their tokenization and image preprocessing run in the
submitting thread). The loop, on its own thread, repeats one *step*:

1. take new requests from the inbox; end cancelled requests and those past their deadline;
2. one decode step for every live sequence (one token each, all slots batched); live sequences
   are first moved down into slots freed below them (KV and decoding rules), so the step's width
   is the number of live sequences, not the highest slot a long one happened to take;
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
Failures stay local: a unit that raises ends the requests it carried with ``"error"`` results.

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
from typing import TYPE_CHECKING

import torch

from ..protocol import SamplingParams
from ..threads import one_torch_thread
from .base import FinishReason, GenerationRequest, GenerationResult, RequestHandle
from .preprocess import EncodedRequest
from .repetition import loop_period
from .sampling import BatchLogitsProcessor

if TYPE_CHECKING:
    from .generate import FastEngine

logger = logging.getLogger(__name__)

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


def _chunk(seq: SequenceState, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The next ``n`` prompt tokens of ``seq`` as a ``Qwen2LM.prefill_chunks`` entry."""
    assert seq.embeds is not None and seq.positions is not None
    rows = slice(seq.prefilled, seq.prefilled + n)
    return seq.embeds[rows], seq.positions[:, rows], slot, seq.prefilled


class Scheduler:
    """Continuous batching over one ``FastEngine`` (see the module docstring).

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
    """

    def __init__(
        self,
        runner: FastEngine,
        slots: int,
        max_seq_len: int,
        admission_budget_s: float = 0.5,
        prefill_chunk_tokens: int = 512,
        vision_pack_patches: int = 8192,
        repetition_window: int = 0,
    ) -> None:
        self.runner = runner
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
            with one_torch_thread():  # the engine thread alone runs multi-threaded ops (see threads)
                encoded = self.runner.preprocessor.encode(request)
            needed = len(encoded.input_ids) + request.sampling.max_new_tokens
            if needed > self.max_seq_len:
                raise ValueError(
                    f"prompt of {len(encoded.input_ids)} tokens + max_new_tokens {request.sampling.max_new_tokens} "
                    f"exceeds the KV buffer length {self.max_seq_len}"
                )
        except Exception as exc:  # a bad request fails alone, with its reason
            handle.set_result(GenerationResult.failed(exc))
            return handle
        self.inbox.put(SequenceState(next(self._counter), request, encoded, handle))
        if start:
            self._ensure_thread()
        return handle

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
        with torch.inference_mode():
            while not self._closed:
                if not self.has_work():
                    try:
                        item = self.inbox.get(timeout=1.0)
                    except queue.Empty:
                        continue
                    if item is None:
                        break
                    self._admit(item)
                try:
                    self.step()
                except Exception:  # a bug in the loop must not strand callers: fail what is in flight
                    logger.exception("engine step failed; ending the requests in flight")
                    for seq in self._all_sequences():
                        self._end(seq, "error", "the engine loop failed (see the log)")
                    self.vision_pack, self.vision_job = [], None

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
            if unit == "vision":
                self._vision_unit()
            else:
                self._prefill_unit()
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
        if self.vision_job is not None:
            return sum(s.encoded.pixel_values.shape[0] for s in self.vision_pack)
        patches = 0
        for seq in self.waiting:
            n = seq.encoded.pixel_values.shape[0]
            if patches and patches + n > self.vision_pack_patches:
                break
            patches += n
        return patches

    def _vision_unit(self) -> None:
        if self.vision_job is None:
            pack: list[SequenceState] = []
            patches = 0
            while self.waiting:
                n = self.waiting[0].encoded.pixel_values.shape[0]
                if pack and patches + n > self.vision_pack_patches:
                    break
                pack.append(self.waiting.pop(0))
                patches += n
            pixels = torch.cat([s.encoded.pixel_values for s in pack])
            self.vision_pack, self.vision_job_s = pack, 0.0
            self.vision_job = self.runner.vision_steps(pixels, [s.encoded.grid_thw for s in pack])
            first = True  # the patch embedding: no block, no rate
        else:
            first = False
        start = self.clock()
        try:
            next(self.vision_job)
            elapsed = self.clock() - start
            self.vision_job_s += elapsed
            if not first:
                self._rate["vision"] = elapsed / max(1, self._pack_patches())
            return
        except StopIteration as stop:
            self.vision_job_s += self.clock() - start
            embeds: torch.Tensor = stop.value
        except Exception as exc:
            logger.exception("vision encoder failed on a pack of %d images", len(self.vision_pack))
            pack, self.vision_pack, self.vision_job = self.vision_pack, [], None
            for seq in pack:
                self._end(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        pack, self.vision_pack, self.vision_job = self.vision_pack, [], None
        self.runner.split_image_embeds(pack, embeds, self.vision_job_s)
        for seq in pack:
            seq.encoded.pixel_values = seq.encoded.pixel_values[:0]  # the pixels are no longer needed
            if seq.ended is not None:
                self._end(seq, seq.ended)
            else:
                bisect.insort(self.ready, seq, key=lambda s: s.order)

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
            seq, slot = self.ready.pop(0), free.pop(0)
            self.runner.start_prefill(seq)
            self.prefilling[slot] = seq
            n = min(budget, seq.prompt_len)
            chunks.append((seq, slot, n))
            budget -= n
        start = self.clock()
        try:
            logits = self.runner.lm.prefill_chunks([_chunk(seq, slot, n) for seq, slot, n in chunks])
        except Exception as exc:
            logger.exception("prefill failed for %d sequences", len(chunks))
            for seq, _, _ in chunks:
                self._end(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        elapsed = self.clock() - start
        total = sum(n for _, _, n in chunks)
        self._rate["prefill"] = elapsed / max(1, total)
        completed: list[tuple[int, torch.Tensor]] = []  # (slot, logits of its first new token)
        for (seq, slot, n), row in zip(chunks, logits, strict=True):
            seq.prefilled += n
            seq.prefill_s += elapsed * n / total
            if seq.prefilled < seq.prompt_len:
                continue
            del self.prefilling[slot]
            seq.embeds = seq.image_embeds = None
            self.rules.reset_row(slot, seq.request.sampling, seq.encoded.forced, seq.encoded.input_ids)
            self.live[slot] = seq
            completed.append((slot, row))
        if completed:
            self._choose([slot for slot, _ in completed], torch.stack([row for _, row in completed]))

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
            self.rules.move_row(top, free)
            self.live[free] = seq

    def _decode_step(self) -> None:
        start = self.clock()
        self._compact()
        width = max(self.live) + 1
        tokens = torch.zeros(width, dtype=torch.long)
        rope = torch.zeros(width, dtype=torch.long)
        cache = torch.zeros(width, dtype=torch.long)
        for slot in range(width):
            seq = self.live.get(slot)
            if seq is not None:
                tokens[slot] = seq.tokens[-1]
                rope[slot] = seq.rope_next - 1
                cache[slot] = seq.prompt_len + len(seq.tokens) - 1
            elif slot in self.prefilling:  # a padding row writes where the next chunk will write
                cache[slot] = self.prefilling[slot].prefilled
        try:
            logits = self.runner.lm.decode(tokens, rope, cache)
        except Exception as exc:
            logger.exception("decode step failed for %d sequences", len(self.live))
            for seq in list(self.live.values()):
                self._end(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        slots = sorted(self.live)
        share = (self.clock() - start) / len(slots)
        for slot in slots:
            self.live[slot].decode_s += share
        self._choose(slots, logits[slots])

    def _choose(self, slots: list[int], logits: torch.Tensor) -> None:
        """Pick each row's token (rules applied), record it with its log-probability, finish rows."""
        log_norm = torch.logsumexp(logits, dim=-1)
        chosen = self.rules(logits.clone(), rows=slots).argmax(dim=-1)
        logprobs = (logits.gather(1, chosen[:, None])[:, 0] - log_norm).tolist()
        for slot, token, logprob in zip(slots, chosen.tolist(), logprobs, strict=True):
            seq = self.live[slot]
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.rope_next += 1
            self.rules.observe([token], rows=[slot])
            reason = self._finish_reason(seq)
            if reason is not None:
                self._end(seq, reason)

    def _finish_reason(self, seq: SequenceState) -> FinishReason | None:
        if seq.tokens[-1] in self.runner.preprocessor.end_ids:
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

    # -- results -------------------------------------------------------------------------------

    def _end(self, seq: SequenceState, reason: FinishReason, error: str | None = None) -> None:
        """Publish ``seq``'s result and remove it from wherever it is."""
        for stage in (self.live, self.prefilling):
            for slot, other in list(stage.items()):
                if other is seq:
                    del stage[slot]
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
        )
        if seq.handle is not None:
            seq.handle.set_result(result)
