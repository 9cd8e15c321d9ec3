"""The fast engine: our own Qwen2-VL with packed vision, static KV buffers and continuous batching.

``FastEngine`` is the model runner (vLLM's split): it loads and quantizes the model and offers the
operations a scheduler combines (vision over a pack of images, block by block; batched, chunked
prefill; one decode step for all slots). ``engine.scheduler.Scheduler`` is the loop that combines
them; ``submit`` / ``generate`` / ``close`` go through it. Requests from every thread share one
batch. Every sequence is bounded by its ``max_new_tokens``, checked against the KV buffer length
before it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from pathlib import Path

import torch

from .base import DTYPES, FollowUp, GenerationRequest, GenerationResult, RequestHandle, generate_with_follow_ups
from .checkpoint import load_model
from .preprocess import Preprocessor
from .quantize import FloatConfig, quantize_
from .scheduler import Scheduler, SequenceState
from .vision_runner import make_vision_runner

logger = logging.getLogger(__name__)

PROMPT_TEXT_TOKENS = 64  # room for the chat template and task prompt around the image (MinerU's use ~30)


class FastEngine:
    """Batched CPU inference of a MinerU2.5 checkpoint with the engine's own model code.

    Args:
        model_dir: checkpoint directory.
        precision: activation/weight dtype, ``"fp32"`` or ``"bf16"``.
        slots: sequences decoded together (KV buffers are allocated for this many).
        max_seq_len: prompt + generated tokens one slot can hold; a request whose prompt plus
            ``max_new_tokens`` does not fit is refused with an ``"error"`` result. None: room for
            the largest image prompt plus ``max_new_tokens``.
        max_new_tokens: the largest output bound requests will use (sizes ``max_seq_len`` when it
            is None).
        kv_dtype: KV buffer storage dtype; None = the activation dtype.
        vision_pack_patches: most patches packed into one vision forward (bounds activation memory
            and, with ``admission_budget_s``, how long a decode step can wait for vision work).
        vision_mode: ``"eager"``, ``"trace"`` or ``"compile"`` (see ``vision_runner``).
        vision_quant / lm_quant / lm_head_quant: ``quantize`` configs, or None for float.
        repetition_window: repetition guard window; a free-running sequence whose last
            ``repetition_window`` tokens are near-periodic (see ``repetition.loop_period``) is
            ended with ``finish_reason="repetition"`` (0 disables; replayed sequences are never cut).
        admission_budget_s / prefill_chunk_tokens: the scheduler's per-step admission budget and
            prefill chunk size (see ``scheduler.Scheduler``).

    Raises:
        ModelLoadError: the checkpoint cannot be read.
    """

    numerics: dict | None = None  # set by engine.factory: choice.describe(options)

    def __init__(
        self,
        model_dir: str | Path,
        precision: str = "fp32",
        slots: int = 16,
        max_seq_len: int | None = None,
        max_new_tokens: int = 8192,
        kv_dtype: torch.dtype | None = None,
        vision_pack_patches: int = 8192,
        vision_mode: str = "eager",
        vision_quant: object | None = None,
        lm_quant: object | None = None,
        lm_head_quant: object | None = None,
        repetition_window: int = 0,
        admission_budget_s: float = 0.5,
        prefill_chunk_tokens: int = 512,
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
        self.quantize(vision_quant, lm_quant, lm_head_quant)
        if max_seq_len is None:
            max_seq_len = self.preprocessor.max_image_tokens + PROMPT_TEXT_TOKENS + max_new_tokens
        self.slots, self.max_seq_len, self.vision_pack_patches = slots, max_seq_len, vision_pack_patches
        self.lm.setup_cache(slots, max_seq_len, kv_dtype or self.dtype)
        self.vocab_size = self.lm.config.vocab_size
        self.scheduler = Scheduler(
            self,
            slots,
            max_seq_len,
            admission_budget_s=admission_budget_s,
            prefill_chunk_tokens=prefill_chunk_tokens,
            vision_pack_patches=vision_pack_patches,
            repetition_window=repetition_window,
        )

    def quantize(self, vision: object | None, lm: object | None, lm_head: object | None) -> None:
        """Apply quantization configs (``quantize.*Config``, or None to keep float) to the vision
        linears, the LM linears and the LM head; float linears end in the engine's dtype."""
        keep = FloatConfig(self.dtype)
        quantize_(self.vision, vision or keep)
        quantize_(self.lm, lm or keep, filter_fn=lambda _, name: name != "lm_head")
        if lm_head is not None or self.lm.lm_head.weight.dtype != self.dtype:
            quantize_(self.lm, lm_head or keep, filter_fn=lambda _, name: name == "lm_head")
        self.vision_runner = make_vision_runner(self.vision, self.vision_mode)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request`` on the engine loop (started on first use); see ``base.Engine``."""
        return self.scheduler.submit(request)

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: FollowUp | None = None
    ) -> list[GenerationResult]:
        """Decode all requests (and ``on_result``'s follow-ups) in the shared batch; results in
        index order. A request that cannot be encoded gets an error result; the others go on."""
        return generate_with_follow_ups(self.submit, requests, on_result)

    def close(self) -> None:
        """Stop the engine loop; unfinished requests end ``"cancelled"``."""
        self.scheduler.close()

    # -- model runner: vision --------------------------------------------------------------------

    def vision_steps(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> Generator[None, None, torch.Tensor]:
        """The vision pass over packed images as a generator of steps (see
        ``VisionEncoder.stepwise``); traced or compiled encoders run whole, in one step."""
        if self.vision_runner is self.vision:
            return self.vision.stepwise(pixel_values, grids)
        return _one_step(lambda: self.vision_runner(pixel_values, grids))

    def split_image_embeds(self, pack: list[SequenceState], embeds: torch.Tensor, elapsed: float) -> None:
        """Hand each sequence of a pack its rows of the vision output ``[patches / 4, hidden]`` and
        its share of ``elapsed`` seconds (by patches)."""
        merge = self.preprocessor.merge_size**2
        total = sum(s.encoded.grid_thw[0] * s.encoded.grid_thw[1] * s.encoded.grid_thw[2] for s in pack)
        offset = 0
        for seq in pack:
            n = seq.encoded.grid_thw[0] * seq.encoded.grid_thw[1] * seq.encoded.grid_thw[2]
            seq.image_embeds = embeds[offset // merge : (offset + n) // merge]
            seq.vision_s += elapsed * n / total
            offset += n

    @torch.inference_mode()
    def encode_images(self, sequences: list[SequenceState]) -> None:
        """Run the whole vision encoder over the sequences' images at once (packed); sets
        ``image_embeds``. For tools and tests; the scheduler interleaves ``vision_steps``."""
        packs: list[list[SequenceState]] = [[]]
        patches = 0
        for seq in sequences:
            n = seq.encoded.pixel_values.shape[0]
            if packs[-1] and patches + n > self.vision_pack_patches:
                packs.append([])
                patches = 0
            packs[-1].append(seq)
            patches += n
        for pack in filter(None, packs):
            pixels = torch.cat([s.encoded.pixel_values for s in pack])
            self.split_image_embeds(pack, self.vision_runner(pixels, [s.encoded.grid_thw for s in pack]), 0.0)

    # -- model runner: language model ------------------------------------------------------------

    def start_prefill(self, seq: SequenceState) -> None:
        """Prompt embeddings (image rows filled from ``image_embeds``) and M-RoPE positions of
        ``seq``; sets ``embeds``, ``positions`` and ``rope_next``."""
        ids = seq.encoded.input_ids
        embeds = self.lm.embed_tokens(ids)
        embeds[ids == self.preprocessor.image_token_id] = seq.image_embeds.to(embeds.dtype)  # type: ignore[union-attr]
        seq.embeds = embeds
        seq.positions = self.preprocessor.mrope_positions(seq.encoded)
        seq.rope_next = int(seq.positions.max()) + 1

    @torch.inference_mode()
    def prefill(self, seq: SequenceState, slot: int) -> torch.Tensor:
        """Prefill ``seq``'s whole prompt into ``slot`` in one forward; returns the logits
        ``[vocab]`` of its first new token. For tools and tests (the scheduler chunks prompts)."""
        self.start_prefill(seq)
        logits = self.lm.prefill_chunks([(seq.embeds, seq.positions, slot, 0)])[0]  # type: ignore[list-item]
        seq.embeds = None
        return logits


def _one_step(run) -> Generator[None, None, torch.Tensor]:
    yield
    return run()
