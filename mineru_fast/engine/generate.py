"""The fast engine: our own Qwen2-VL with packed vision, static KV buffers and continuous batching.

``FastEngine`` is the model runner (vLLM's split): it loads and quantizes the model and offers the
operations a scheduler combines (vision over a pack of images, block by block; batched, chunked
prefill; one decode step for all slots). ``engine.scheduler.Scheduler`` is the loop that combines
them; ``submit`` / ``generate`` / ``close`` go through it. Requests from every thread share one
batch. Every sequence is bounded by its ``max_new_tokens``, checked against the KV buffer length
before it starts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mineru_fast.engine.base import (
    DTYPES,
    FollowUp,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    generate_with_follow_ups,
)
from mineru_fast.engine.checkpoint import load_model, read_configs
from mineru_fast.engine.kernels import kernel_status, vision_attention_status
from mineru_fast.engine.kv_cache import KVCache
from mineru_fast.engine.memory import peak_rss_bytes, resident_bytes, rss_bytes, trim_heap
from mineru_fast.engine.model import Qwen2LM
from mineru_fast.engine.prepared import PreparedCache, PreparedCacheError, cacheable, prepared_settings
from mineru_fast.engine.preprocess import Preprocessor
from mineru_fast.engine.quantize import quantize_linear
from mineru_fast.engine.scheduler import Scheduler, SequenceState
from mineru_fast.engine.vision import VISION_STAGES, VisionEncoder, pack_qkv_by_head_group
from mineru_fast.engine.vision_runner import make_vision_runner

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
        vision_attention: ``"fp32"`` (PyTorch's SDPA) or ``"bf16"``: this CPU class's fast attention
            where it runs (float32 precision, eager mode; ``kernels.vision_attention_status``:
            PyTorch's bfloat16 SDPA on AMX, the own bfloat16 kernel on AVX-512 BF16, the own float32
            kernel on the AVX2 class; elsewhere float32 SDPA). ``vision_attention_reason`` says which
            runs.
        vision_quant / lm_quant / lm_head_quant: ``quantize`` configs, or None for float.
        repetition_window: repetition guard window; a free-running sequence whose last
            ``repetition_window`` tokens are near-periodic (see ``repetition.loop_period``) is
            ended with ``finish_reason="repetition"`` (0 disables; replayed sequences are never cut).
        admission_budget_s / prefill_chunk_tokens: the scheduler's per-step admission budget and
            prefill chunk size (see ``scheduler.Scheduler``).

    Raises:
        ModelLoadError: the checkpoint cannot be read.
    """

    numerics: dict | None = None  # set by engine.factory: numerics.describe(options)

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
        vision_attention: str = "fp32",
        vision_quant: object | None = None,
        lm_quant: object | None = None,
        lm_head_quant: object | None = None,
        repetition_window: int = 0,
        admission_budget_s: float = 0.5,
        prefill_chunk_tokens: int = 512,
        prepared_cache: Path | None = None,
    ) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.dtype = DTYPES[precision]
        self.preprocessor = Preprocessor(model_dir)
        configs = {"vision": vision_quant, "lm": lm_quant, "lm_head": lm_head_quant}
        self.prepared_from: str | None = None  # "cache" or "checkpoint" once loaded
        self.cache_committed = False  # this load wrote the prepared cache's entry
        self.prepared_entry: Path | None = None  # the prepared cache's entry read or written (or committed meanwhile)
        self.prepared_problem: str | None = None  # why this load's entry was not written, if it was not
        self.vision, self.lm = self._load(Path(model_dir), configs, prepared_cache)
        self.vision_mode = vision_mode
        self.vision_attention_reason = self._attention(vision_attention)
        self.vision_runner = make_vision_runner(self.vision, self.vision_mode)
        if max_seq_len is None:
            max_seq_len = self.preprocessor.max_image_tokens + PROMPT_TEXT_TOKENS + max_new_tokens
        self.slots, self.max_seq_len, self.vision_pack_patches = slots, max_seq_len, vision_pack_patches
        self.lm.setup_cache(slots, max_seq_len, kv_dtype or self.dtype)
        self.decode_attention_reason = self._decode_attention(kv_dtype or self.dtype)
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

    def _attention(self, wanted: str) -> str:
        """Put the vision encoder's attention on this CPU class's fast attention
        (``vision_attention_status``) where ``wanted`` asks for it and it can run; the reason, one
        line, either way.

        Raises:
            ValueError: ``wanted`` is neither ``"fp32"`` nor ``"bf16"``.
        """
        if wanted not in ("fp32", "bf16"):
            raise ValueError(f"vision_attention must be fp32 or bf16, got {wanted!r}")
        sdpa = f"PyTorch SDPA in {str(self.dtype).removeprefix('torch.')}"
        if wanted == "fp32":
            return sdpa
        if self.dtype != torch.float32:
            return f"{sdpa} (the fast attention takes float32 activations)"
        if self.vision_mode != "eager":
            return f"{sdpa} (the fast attention runs in the eager vision mode only)"
        head_dim = self.vision.config.head_dim
        if head_dim % 16 or not 16 <= head_dim <= 128:
            return f"{sdpa} (the fast attention takes head sizes of 16 to 128 in steps of 16, not {head_dim})"
        status = vision_attention_status()
        self.vision.use_attention_kernel(status.attention)
        return status.reason

    def _decode_attention(self, kv_dtype: torch.dtype) -> str:
        """Put the language model's decode-step attention on the own kernel where it runs (float32
        activations and KV buffers, the ``avx512_vnni`` or ``avx2`` path); the reason, one line, either way."""
        sdpa = "PyTorch operators and SDPA"
        if self.dtype != torch.float32 or kv_dtype != torch.float32:
            return f"{sdpa} (the own decode attention takes float32 activations and KV buffers)"
        status = kernel_status()
        if status.decode_attention is None:
            return f"{sdpa} (the own decode attention needs the kernels' avx512_vnni or avx2 path: {status.reason})"
        self.lm.use_decode_kernel(status.decode_attention)
        reason = (
            f"own decode attention ({status.path} path, float32): rotary embedding, KV write and attention in one call"
        )
        if status.decoder is None or not self.lm.blockwise_decoder:
            return reason
        self.lm.use_decoder_kernels(status.decoder)
        return f"{reason}; a decode step's decoder layers in one call (RMSNorm and SiLU in the kernels' arithmetic)"

    def _load(
        self, model_dir: Path, configs: dict[str, object | None], cache_root: Path | None
    ) -> tuple[VisionEncoder, Qwen2LM]:
        """The prepared vision encoder and LM: from the prepared cache under ``cache_root`` when it
        holds them, else from the checkpoint, each linear quantized as soon as its weights are read
        (from the checkpoint's dtype: no float32 copy ever exists, and the stored weights of one
        layer at a time are alive), and written to the cache on the way when caching pays."""
        cache = None
        text_config, vision_config = read_configs(model_dir)
        if cache_root is not None and cacheable(configs.values()):
            cache = PreparedCache(cache_root, model_dir, prepared_settings(self.dtype, configs))
            if cache.exists():
                with torch.device("meta"):
                    vision, lm = VisionEncoder(vision_config), Qwen2LM(text_config)
                try:
                    cache.load(vision, lm)
                    self.prepared_from, self.prepared_entry = "cache", cache.path
                    logger.info("prepared model read from the cache: %s", cache.path)
                    return vision.eval(), lm.eval()
                except PreparedCacheError as exc:
                    logger.warning("%s; preparing the model from the checkpoint again", exc)
                    cache.discard()
        writer = cache.writer() if cache is not None else None

        def preparer(part: str) -> Callable[[str, nn.Linear], nn.Module]:
            def prepare(name: str, linear: nn.Linear) -> nn.Module:
                config = configs["lm_head" if (part, name) == ("lm", "lm_head") else part]
                layer = linear.to(self.dtype) if config is None else quantize_linear(linear, config)
                if part == "vision" and name.endswith(".qkv"):
                    pack_qkv_by_head_group(layer, vision_config)
                if writer is not None:
                    writer.add(part, name, layer)
                return layer

            return prepare

        vision, lm = load_model(model_dir, self.dtype, prepare_vision=preparer("vision"), prepare_lm=preparer("lm"))
        self.prepared_from = "checkpoint"
        committed = writer is not None and writer.commit(vision, lm)
        if cache is not None and writer is not None and not committed:
            if cache.exists():  # another process committed the same entry first: it is there to read
                self.prepared_entry = cache.path
            else:
                self.prepared_problem = writer.problem
        if committed and cache is not None:
            self.prepared_entry = cache.path
            head = lm.lm_head
            tied = isinstance(head, nn.Linear) and head.weight is lm.embed.weight
            lm.embed.weight = cache.mapped("lm", "embed.weight")  # the in-memory table is freed
            if tied:  # a float head sharing the table follows it
                head.weight = lm.embed.weight
            self.cache_committed = True
            trim_heap()
        return vision, lm

    def memory_report(self) -> dict[str, Any]:
        """Where this process's memory is, in bytes: the weights by role and form, the KV buffers
        reserved and committed, the embedding table's size and resident part (memory-mapped from
        the prepared cache, or in memory), and the process's resident size now and at its peak.
        ``other`` is the resident size not accounted for by those: the PyTorch runtime, the
        tokenizer, live activations and the allocator's free blocks. Values None where /proc is
        missing."""
        parts: dict[str, int] = {}
        for part, module in (("vision", self.vision), ("lm", self.lm)):
            for name, layer in module.named_modules():
                tied = name == "lm_head" and getattr(layer, "weight", None) is self.lm.embed.weight
                if name == "embed" or tied or isinstance(layer, KVCache) or any(True for _ in layer.children()):
                    continue  # the embedding (and a head tied to it) and KV buffers are reported below
                role = f"{part} {'head' if name == 'lm_head' else 'linears' if _is_linear(layer) else 'norms'}"
                form = _weight_form(layer)
                key = f"{role} ({form})"
                if size := _layer_bytes(layer):
                    parts[key] = parts.get(key, 0) + size
        caches = [layer.attention.kv_cache for layer in self.lm.decoder_layers]
        kv = [t for c in caches if c is not None for t in (c.k, c.v)]
        embed = self.lm.embed.weight
        report: dict[str, Any] = {
            "weights": parts,
            "embedding": {
                "bytes": embed.numel() * embed.element_size(),
                "dtype": str(embed.dtype).removeprefix("torch."),
                "mapped": self.prepared_from == "cache" or self.cache_committed,
                "resident": resident_bytes([embed]),
            },
            "kv": {"reserved": sum(t.numel() * t.element_size() for t in kv), "committed": resident_bytes(kv)},
            "rss": rss_bytes(),
            "peak_rss": peak_rss_bytes(),
            "prepared_from": self.prepared_from,
        }
        known = sum(parts.values()) + (report["kv"]["committed"] or 0)
        known += report["embedding"]["resident"] or 0
        report["other"] = None if report["rss"] is None else report["rss"] - known
        return report

    def stage_seconds(self) -> dict[str, float]:
        """Seconds the engine loop spent per stage since it was built, cumulative (take the
        difference of two calls for a span of work; read between requests, not during them):
        ``vision_linears``, ``vision_attention`` and ``vision_other`` (the vision units split by
        ``VisionEncoder.seconds``; ``other`` is norms, activations, residual additions, the patch
        embedding, the merger, rotary tables, the pack's pixels and outputs and the heap trim),
        ``prefill``, ``decode_forward``, ``decode_other`` and ``idle`` (``scheduler.LOOP_STAGES``).
        A span's wall time less their sum is the loop's own work between units (admission,
        expiry) and time the loop thread waited for a CPU. Eager blocks are split; a compiled
        runner's passes, and a traced one's once traced for a grid, count as ``vision_other``.
        Vision passes run outside the loop in the span (``encode_images``) make ``vision_other``
        smaller, even negative: read spans of the loop's work alone."""
        loop = self.scheduler.stage_seconds()
        vision = self.vision.seconds
        stages = {f"vision_{name}": vision[name] for name in VISION_STAGES}
        stages["vision_other"] = loop.pop("vision") - sum(stages.values())
        return stages | loop

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
        ``VisionEncoder.stepwise``); traced or compiled encoders run whole, in one step.

        Only the steps hold ``pixel_values``: the eager encoder lets go of them once they are
        embedded, so a caller that drops its own reference frees them for the rest of the pass.
        Once the pass is done the heap is trimmed: a layout image's activations (~0.3 GB) are
        freed blocks of glibc's heap, which it would keep, and a later pack of other sizes would
        not reuse them all (measured on the full-size model: 0.28 GB resident that a trim returns)."""
        steps = (
            self.vision.stepwise(pixel_values, grids)
            if self.vision_runner is self.vision
            else _one_step(functools.partial(self.vision_runner, pixel_values, grids))
        )
        del pixel_values
        embeds = yield from steps
        trim_heap()
        return embeds

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


def _is_linear(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) or hasattr(layer, "out_features")


def _weight_form(layer: nn.Module) -> str:
    if isinstance(layer, nn.Linear):
        return str(layer.weight.dtype).removeprefix("torch.")
    return type(layer).__name__


def _layer_bytes(layer: nn.Module) -> int:
    """Bytes of a layer's own tensors; oneDNN's packed INT8 weight (not a buffer) as 1 byte per weight."""
    own = sum(t.numel() * t.element_size() for t in [*layer.parameters(False), *layer.buffers(False)])
    packed_bytes = getattr(layer, "packed_bytes", None)
    return own + (packed_bytes() if packed_bytes is not None else 0)


def _one_step(run) -> Generator[None, None, torch.Tensor]:
    yield
    return run()
