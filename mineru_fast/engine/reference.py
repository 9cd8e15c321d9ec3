"""The reference engine: transformers' own Qwen2-VL, used the way the official client uses it.

``Qwen2VLForConditionalGeneration.generate`` at batch 1, greedy, SDPA attention, with MinerU's
decoding rules added as a logits processor (``sampling.BatchLogitsProcessor``). It is the
correctness reference of the fast engine and the benchmark's baseline. Requests from every thread
queue for one worker thread, which runs them one at a time in submission order.

Inputs come from ``preprocess.Preprocessor`` (the checkpoint's tokenizer and image processor).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mineru_fast.engine.base import (
    DTYPES,
    FollowUp,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    generate_with_follow_ups,
)
from mineru_fast.engine.preprocess import Preprocessor
from mineru_fast.engine.sampling import BatchLogitsProcessor, log_normalizer

logger = logging.getLogger(__name__)


class _StageTimer:
    """Forward hooks that split a ``generate`` call into vision, prefill and decode seconds.

    transformers may run the vision encoder inside the first forward or before it (pre-encoded
    multimodal inputs); either way ``prefill_s`` is the first forward without vision time.
    """

    def __init__(self, model: torch.nn.Module, vision: torch.nn.Module) -> None:
        self.vision_s = 0.0
        self.forward_s: list[float] = []
        self._vision_in_forward: list[float] = []
        self._t_vision = self._t_forward = 0.0
        self._handles = [
            vision.register_forward_pre_hook(self._vision_start),
            vision.register_forward_hook(self._vision_end),
            model.register_forward_pre_hook(self._forward_start),
            model.register_forward_hook(self._forward_end),
        ]

    def _vision_start(self, *_: object) -> None:
        self._t_vision = time.perf_counter()

    def _vision_end(self, *_: object) -> None:
        elapsed = time.perf_counter() - self._t_vision
        self.vision_s += elapsed
        if len(self._vision_in_forward) > len(self.forward_s):  # inside a forward
            self._vision_in_forward[-1] += elapsed

    def _forward_start(self, *_: object) -> None:
        self._vision_in_forward.append(0.0)
        self._t_forward = time.perf_counter()

    @property
    def prefill_s(self) -> float:
        return self.forward_s[0] - self._vision_in_forward[0] if self.forward_s else 0.0

    def _forward_end(self, *_: object) -> None:
        self.forward_s.append(time.perf_counter() - self._t_forward)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _GeneratedTokensProcessor:
    """Adapts ``BatchLogitsProcessor`` (batch 1) to transformers' ``LogitsProcessor`` call."""

    def __init__(self, rules: BatchLogitsProcessor, prompt_len: int) -> None:
        self.rules = rules
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_len
        if generated > len(self.rules.blockers[0].tokens):
            self.rules.observe([int(input_ids[0, -1])])
        return self.rules(scores.to(torch.float32, copy=True))  # raw logits stay intact for log-probs


class ReferenceEngine:
    """transformers ``generate`` at batch 1 (see module docstring).

    Args:
        model_dir: a MinerU2.5 / Qwen2-VL checkpoint directory.
        precision: ``"fp32"`` or ``"bf16"`` (weights and activations).

    Raises:
        ModelLoadError: the directory cannot be loaded by transformers.
    """

    numerics: dict | None = None  # set by engine.factory: numerics.describe(options)

    def __init__(self, model_dir: str | Path, precision: str = "bf16") -> None:
        from transformers import Qwen2VLForConditionalGeneration
        from transformers import logging as hf_logging

        from mineru_fast.errors import ModelLoadError

        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.preprocessor = Preprocessor(model_dir)
        hf_logging.disable_progress_bar()
        try:
            self.model = Qwen2VLForConditionalGeneration.from_pretrained(
                str(model_dir), dtype=DTYPES[precision], attn_implementation="sdpa"
            ).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"transformers cannot load {model_dir}: {exc}") from exc
        finally:
            hf_logging.enable_progress_bar()
        self.precision = precision
        self.end_ids = self.preprocessor.end_ids
        self.vocab_size = self.model.config.text_config.vocab_size
        self._queue: queue.SimpleQueue[RequestHandle | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def encode(self, request: GenerationRequest) -> dict[str, torch.Tensor]:
        """Model inputs of one request, as ``Qwen2VLProcessor`` returns them: ``input_ids``,
        ``attention_mask`` and ``mm_token_type_ids`` ``[1, L]`` (1 marks image tokens; without it
        transformers silently falls back to 1-D positions instead of M-RoPE), ``pixel_values``
        ``[patches, 3*2*14*14]`` float32, ``image_grid_thw`` ``[1, 3]``."""
        encoded = self.preprocessor.encode(request)
        ids = encoded.input_ids[None]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == self.preprocessor.image_token_id).to(torch.int32),
            "pixel_values": encoded.pixel_values,
            "image_grid_thw": torch.tensor([encoded.grid_thw]),
        }

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request`` for the worker thread (started on first use); see ``base.Engine``."""
        handle = RequestHandle(request)
        with self._lock:
            if self._closed:
                handle.set_result(GenerationResult("", [], "cancelled", error="the engine is closed"))
                return handle
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mineru-fast-reference", daemon=True)
                self._thread.start()
                atexit.register(_close_at_exit, weakref.ref(self))  # see scheduler._close_at_exit
        self._queue.put(handle)
        return handle

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode each request in turn (batch 1), follow-ups from ``on_result`` after the requests
        already queued; a failing request returns an error result."""
        return generate_with_follow_ups(self.submit, requests, on_result)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker; the running request and queued ones end ``"cancelled"``."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle.set_result(GenerationResult("", [], "cancelled"))

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None or self._closed:
                if handle is not None:
                    handle.set_result(GenerationResult("", [], "cancelled"))
                return
            try:
                result = self._generate_one(handle)
            except Exception as exc:  # one bad request must not sink the others
                logger.exception("generation failed")
                result = GenerationResult.failed(exc)
            handle.set_result(result)

    @torch.inference_mode()
    def _generate_one(self, handle: RequestHandle) -> GenerationResult:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        request = handle.request
        inputs = self.encode(request)
        prompt_len = inputs["input_ids"].shape[1]
        forced = self.preprocessor.forced_ids(request.forced_text) if request.forced_text is not None else None
        rules = BatchLogitsProcessor([request.sampling], [forced], self.vocab_size, self.end_ids)
        rules.reset_row(0, request.sampling, forced, inputs["input_ids"][0])
        config = GenerationConfig(
            max_new_tokens=request.sampling.max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.end_ids,
            pad_token_id=self.end_ids[1],
            return_dict_in_generate=True,
            output_logits=True,
        )
        stop = _HandleStop(handle, lambda: self._closed)
        timer = _StageTimer(self.model, self.model.model.visual)
        start = time.perf_counter()
        try:
            output = self.model.generate(
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([_GeneratedTokensProcessor(rules, prompt_len)]),
                stopping_criteria=StoppingCriteriaList([stop]),
            )
        finally:
            total = time.perf_counter() - start
            timer.remove()
        token_ids = output.sequences[0, prompt_len:].tolist()
        logits = torch.cat(output.logits).float()  # [steps, vocab], raw (before the rules)
        logprobs = (logits.gather(1, torch.tensor(token_ids)[:, None])[:, 0] - log_normalizer(logits)).tolist()
        if stop.reason is not None:
            reason = stop.reason
        elif token_ids and token_ids[-1] in self.end_ids:
            reason = "stop"
        else:
            reason = "length"
        return GenerationResult(
            text=self.preprocessor.decode(token_ids),
            token_ids=token_ids,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=prompt_len,
            vision_s=timer.vision_s,
            prefill_s=timer.prefill_s,
            decode_s=total - timer.vision_s - timer.prefill_s,
            logprobs=logprobs,
        )


def _close_at_exit(ref: weakref.ref[ReferenceEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close(timeout=10)


class _HandleStop:
    """A transformers stopping criterion that ends generation when the handle is cancelled (or
    the engine closed) or the request's deadline passes; ``reason`` says which."""

    def __init__(self, handle: RequestHandle, closed: Callable[[], bool]) -> None:
        self.handle, self.closed = handle, closed
        self.reason: str | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **_: object) -> torch.BoolTensor:
        deadline = self.handle.request.deadline
        if self.handle.cancel_requested or self.closed():
            self.reason = "cancelled"
        elif deadline is not None and time.monotonic() >= deadline:
            self.reason = "timeout"
        return torch.full((input_ids.shape[0],), self.reason is not None, dtype=torch.bool)  # type: ignore[return-value]
