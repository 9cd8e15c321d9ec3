"""The fast engine: our own Qwen2-VL with packed vision, static KV buffers and continuous batching.

``FastEngine.generate(requests)``:

1. encodes every request (tokenizer + image processor) and runs the vision encoder over the images
   packed into sequences of at most ``vision_pack_patches`` patches;
2. keeps up to ``slots`` sequences decoding together; whenever a slot is free it prefills the next
   pending request into it (continuous batching), then all live slots decode one token per step;
   requests that follow from a finished one (a page's crops after its layout) join the running
   batch at once, so they decode alongside the other pages' layout passes;
3. applies the batched decoding rules (``sampling.BatchLogitsProcessor``) per row, so requests of
   different block types share a batch; replay forces tokens exactly as the reference engine does.

Every sequence is bounded by its ``max_new_tokens`` and by the KV buffer length.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..protocol import SamplingParams
from .base import DTYPES, FollowUp, GenerationRequest, GenerationResult
from .checkpoint import load_model
from .preprocess import EncodedRequest, Preprocessor
from .quantize import FloatConfig, quantize_
from .sampling import BatchLogitsProcessor
from .vision_runner import make_vision_runner

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """A request in flight."""

    index: int
    request: GenerationRequest
    encoded: EncodedRequest
    image_embeds: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    rope_next: int = 0  # M-RoPE position of the next token
    vision_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class FastEngine:
    """Batched CPU inference of a MinerU2.5 checkpoint with the engine's own model code.

    Args:
        model_dir: checkpoint directory.
        precision: activation/weight dtype, ``"fp32"`` or ``"bf16"``.
        slots: sequences decoded together (KV buffers are allocated for this many).
        max_seq_len: prompt + generated tokens one slot can hold; longer sequences stop with
            ``finish_reason="length"``.
        kv_dtype: KV buffer storage dtype; None = the activation dtype.
        vision_pack_patches: most patches packed into one vision forward (bounds activation memory).
        vision_mode: ``"eager"``, ``"trace"`` or ``"compile"`` (see ``vision_runner``).
        vision_quant / lm_quant / lm_head_quant: ``quantize`` configs, or None for float.
        repetition_window: repetition guard; a free-running sequence whose last
            ``repetition_window`` tokens hold at most 2 distinct ids is ended with
            ``finish_reason="repetition"`` (0 disables; replayed sequences are never cut).

    Raises:
        ModelLoadError: the checkpoint cannot be read.
    """

    def __init__(
        self,
        model_dir: str | Path,
        precision: str = "fp32",
        slots: int = 16,
        max_seq_len: int = 6144,
        kv_dtype: torch.dtype | None = None,
        vision_pack_patches: int = 16384,
        vision_mode: str = "eager",
        vision_quant: object | None = None,
        lm_quant: object | None = None,
        lm_head_quant: object | None = None,
        repetition_window: int = 0,
    ) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.dtype = DTYPES[precision]
        self.preprocessor = Preprocessor(model_dir)
        # Layers about to be quantized load in the checkpoint's bfloat16: no float32 copy ever exists.
        self.vision, self.lm = load_model(
            model_dir,
            self.dtype,
            vision_linear_dtype=torch.bfloat16 if vision_quant is not None else None,  # the checkpoint's dtype
            lm_linear_dtype=torch.bfloat16 if (lm_quant or lm_head_quant) is not None else None,
        )
        self.vision_mode = vision_mode
        self.repetition_window = repetition_window
        self.quantize(vision_quant, lm_quant, lm_head_quant)
        self.slots, self.max_seq_len, self.vision_pack_patches = slots, max_seq_len, vision_pack_patches
        self.lm.setup_cache(slots, max_seq_len, kv_dtype or self.dtype)
        self.vocab_size = self.lm.config.vocab_size

    def quantize(self, vision: object | None, lm: object | None, lm_head: object | None) -> None:
        """Apply quantization configs (``quantize.*Config``, or None to keep float) to the vision
        linears, the LM linears and the LM head; float linears end in the engine's dtype."""
        keep = FloatConfig(self.dtype)
        quantize_(self.vision, vision or keep)
        quantize_(self.lm, lm or keep, filter_fn=lambda _, name: name != "lm_head")
        if lm_head is not None or self.lm.lm_head.weight.dtype != self.dtype:
            quantize_(self.lm, lm_head or keep, filter_fn=lambda _, name: name == "lm_head")
        self.vision_runner = make_vision_runner(self.vision, self.vision_mode)

    # -- vision -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, sequences: list[_Sequence]) -> None:
        """Run the vision encoder over the sequences' images, packed; sets ``image_embeds``."""
        pack: list[_Sequence] = []
        patches = 0
        for seq in sorted(sequences, key=lambda s: s.encoded.pixel_values.shape[0]):
            n = seq.encoded.pixel_values.shape[0]
            if pack and patches + n > self.vision_pack_patches:
                self._encode_pack(pack)
                pack, patches = [], 0
            pack.append(seq)
            patches += n
        if pack:
            self._encode_pack(pack)

    def _encode_pack(self, pack: list[_Sequence]) -> None:
        start = time.perf_counter()
        pixels = torch.cat([s.encoded.pixel_values for s in pack])
        embeds = self.vision_runner(pixels, [s.encoded.grid_thw for s in pack])
        elapsed = time.perf_counter() - start
        total = pixels.shape[0]
        offset = 0
        merge = self.preprocessor.merge_size**2
        for seq in pack:
            n = seq.encoded.pixel_values.shape[0]
            seq.image_embeds = embeds[offset // merge : (offset + n) // merge]
            seq.vision_s = elapsed * n / total
            offset += n

    # -- language model -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seq: _Sequence, slot: int) -> torch.Tensor:
        """Prefill ``seq`` into ``slot``; returns the logits ``[vocab]`` of its first new token."""
        ids = seq.encoded.input_ids
        embeds = self.lm.embed_tokens(ids)
        image_rows = ids == self.preprocessor.image_token_id
        embeds[image_rows] = seq.image_embeds.to(embeds.dtype)
        positions = self.preprocessor.mrope_positions(seq.encoded)
        seq.rope_next = int(positions.max()) + 1
        return self.lm.prefill(embeds[None], positions[:, None], slot)[0]

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode all requests with continuous batching; results in request order.

        ``on_result(index, result)`` (optional) is called as each request finishes and may return
        follow-up requests (a page's crops once its layout is known); they are admitted at once,
        share the running batch, and take the next indices in the order returned. A request that
        cannot be encoded gets an error result; the others are unaffected.
        """
        results: list[GenerationResult | None] = []
        pending: deque[_Sequence] = deque()
        finished: deque[int] = deque()  # indices whose result awaits on_result

        def admit(batch: Sequence[GenerationRequest]) -> None:
            admitted = []
            for request in batch:
                index = len(results)
                results.append(None)
                try:
                    encoded = self.preprocessor.encode(request)
                    if len(encoded.input_ids) >= self.max_seq_len:
                        raise ValueError(f"prompt of {len(encoded.input_ids)} tokens exceeds max_seq_len")
                except (ValueError, RuntimeError) as exc:
                    results[index] = GenerationResult("", [], "error", error=f"{type(exc).__name__}: {exc}")
                    finished.append(index)
                    continue
                admitted.append(_Sequence(index, request, encoded))
            self.encode_images(admitted)
            pending.extend(admitted)

        def finish(slot: int) -> None:
            seq = live.pop(slot)
            results[seq.index] = self._result(seq)
            finished.append(seq.index)

        admit(requests)
        rules = BatchLogitsProcessor([SamplingParams()] * self.slots, [None] * self.slots, self.vocab_size)
        live: dict[int, _Sequence] = {}
        while pending or live or finished:
            while finished:
                index = finished.popleft()
                if on_result is not None:
                    admit(on_result(index, results[index]) or ())  # type: ignore[arg-type]
            for slot in range(self.slots):  # refill free slots (lowest first keeps the batch dense)
                if slot not in live and pending:
                    seq = pending.popleft()
                    start = time.perf_counter()
                    logits = self.prefill(seq, slot)
                    rules.reset_row(slot, seq.request.sampling, seq.encoded.forced)
                    token = int(rules(logits[None].clone(), rows=[slot]).argmax())
                    self._append(rules, slot, seq, token)
                    seq.prefill_s = time.perf_counter() - start
                    live[slot] = seq
                    if self._finished(seq) is not None:
                        finish(slot)
            if not live:
                continue
            start = time.perf_counter()
            width = max(live) + 1
            tokens = torch.zeros(width, dtype=torch.long)
            rope = torch.zeros(width, dtype=torch.long)
            cache = torch.zeros(width, dtype=torch.long)
            for slot, seq in live.items():
                tokens[slot] = seq.tokens[-1]
                rope[slot] = seq.rope_next - 1
                cache[slot] = len(seq.encoded.input_ids) + len(seq.tokens) - 1
            logits = self.lm.decode(tokens, rope, cache)
            chosen = rules(logits).argmax(dim=-1).tolist()
            elapsed = (time.perf_counter() - start) / len(live)
            for slot in list(live):
                seq = live[slot]
                self._append(rules, slot, seq, chosen[slot])
                seq.decode_s += elapsed
                if self._finished(seq) is not None:
                    finish(slot)
        return results  # type: ignore[return-value]

    def _append(self, rules: BatchLogitsProcessor, slot: int, seq: _Sequence, token: int) -> None:
        seq.tokens.append(token)
        seq.rope_next += 1
        rules.observe([token], rows=[slot])

    def _finished(self, seq: _Sequence) -> str | None:
        if seq.tokens[-1] in self.preprocessor.end_ids:
            return "stop"
        if len(seq.tokens) >= seq.request.sampling.max_new_tokens:
            return "length"
        if len(seq.encoded.input_ids) + len(seq.tokens) >= self.max_seq_len:
            return "length"
        window = self.repetition_window
        if window and seq.encoded.forced is None and len(seq.tokens) >= window and len(set(seq.tokens[-window:])) <= 2:
            return "repetition"
        return None

    def _result(self, seq: _Sequence) -> GenerationResult:
        return GenerationResult(
            text=self.preprocessor.decode(seq.tokens),
            token_ids=seq.tokens,
            finish_reason=self._finished(seq) or "length",  # type: ignore[arg-type]
            prompt_tokens=len(seq.encoded.input_ids),
            vision_s=seq.vision_s,
            prefill_s=seq.prefill_s,
            decode_s=seq.decode_s,
        )
