"""The reference engine: transformers' own Qwen2-VL, used the way the official client uses it.

``Qwen2VLForConditionalGeneration.generate`` at batch 1, greedy, SDPA attention, with MinerU's
decoding rules added as a logits processor (``sampling.BatchLogitsProcessor``). It is the
correctness reference of the fast engine and the benchmark's baseline.

Inputs come from ``preprocess.Preprocessor`` (the checkpoint's tokenizer and image processor).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .base import DTYPES, FollowUp, GenerationRequest, GenerationResult
from .preprocess import Preprocessor
from .sampling import BatchLogitsProcessor

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

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids.shape[1] - self.prompt_len
        if generated > len(self.rules.blockers[0].tokens):
            self.rules.observe([int(input_ids[0, -1])])
        return self.rules(scores.float())


class ReferenceEngine:
    """transformers ``generate`` at batch 1 (see module docstring).

    Args:
        model_dir: a MinerU2.5 / Qwen2-VL checkpoint directory.
        precision: ``"fp32"`` or ``"bf16"`` (weights and activations).

    Raises:
        ModelLoadError: the directory cannot be loaded by transformers.
    """

    def __init__(self, model_dir: str | Path, precision: str = "bf16") -> None:
        from transformers import Qwen2VLForConditionalGeneration
        from transformers import logging as hf_logging

        from ..errors import ModelLoadError

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

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode each request in turn (batch 1), follow-ups from ``on_result`` after the requests
        already queued; a failing request returns an error result."""
        queue, results = list(requests), []
        for index, request in enumerate(queue):  # grows while iterating: follow-ups are appended
            try:
                result = self._generate_one(request)
            except Exception as exc:  # one bad request must not sink the others
                logger.exception("generation failed")
                result = GenerationResult("", [], "error", error=f"{type(exc).__name__}: {exc}")
            results.append(result)
            if on_result is not None:
                queue.extend(on_result(index, result) or ())
        return results

    @torch.inference_mode()
    def _generate_one(self, request: GenerationRequest) -> GenerationResult:
        from transformers import GenerationConfig, LogitsProcessorList

        inputs = self.encode(request)
        prompt_len = inputs["input_ids"].shape[1]
        forced = self.preprocessor.forced_ids(request.forced_text) if request.forced_text is not None else None
        rules = BatchLogitsProcessor([request.sampling], [forced], self.vocab_size)
        config = GenerationConfig(
            max_new_tokens=request.sampling.max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.end_ids,
            pad_token_id=self.end_ids[1],
        )
        timer = _StageTimer(self.model, self.model.model.visual)
        start = time.perf_counter()
        try:
            output = self.model.generate(
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([_GeneratedTokensProcessor(rules, prompt_len)]),
            )
        finally:
            total = time.perf_counter() - start
            timer.remove()
        token_ids = output[0, prompt_len:].tolist()
        return GenerationResult(
            text=self.preprocessor.decode(token_ids),
            token_ids=token_ids,
            finish_reason="stop" if token_ids and token_ids[-1] in self.end_ids else "length",
            prompt_tokens=prompt_len,
            vision_s=timer.vision_s,
            prefill_s=timer.prefill_s,
            decode_s=total - timer.vision_s - timer.prefill_s,
        )
