"""Qwen2 language model of MinerU2.5: GQA decoder with M-RoPE, static KV buffers, tied head.

gpt-fast style: prefill (one prompt, causal attention over itself) and decode (one token for each
of B slots, attention over each slot's own cached prefix) are separate methods. q/k/v and
gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mineru_fast.engine.kv_cache import KVCache
from mineru_fast.engine.quantize import BlockInt8Linear

if TYPE_CHECKING:
    from mineru_fast.engine.kernels import BoundDecoder, DecodeAttention, DecoderKernels, DecoderLayerRefs


@dataclass(frozen=True)
class TextConfig:
    """Hyper-parameters of the language model (from the checkpoint's ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` in float32, cast back to ``x``'s dtype before the
    weight (transformers' Qwen2RMSNorm). On float32 ``torch.rms_norm`` is one call of those same
    operators (a composite in PyTorch's C++: the same bits, tested), where the operators one by one
    from Python cost ~15 us against ~11 per call on a decode row (2 threads, EPYC), 49 calls per
    decode step (called as ``torch.rms_norm``, not through ``F.rms_norm``'s Python wrapper: 7.0
    against 7.7 us a call, Zen 5 EPYC); on bfloat16 it rounds otherwise, so the operators run one
    by one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MRoPE(nn.Module):
    """Multimodal rotary embedding: the head's frequency bands are split into sections driven by
    the temporal, height and width position of each token (text tokens have all three equal)."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # Plain float32 attributes, not buffers: they must stay float32 and on the CPU whatever
        # dtype or device the weights are built in.
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        # band j of the half-dimension takes its angle from axis axis_of_band[j] (0=t, 1=h, 2=w)
        self.axis_of_band = torch.cat(
            [torch.full((n,), i % 3, device="cpu") for i, n in enumerate(config.mrope_section)]
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[3, B, T]`` int64 -> ``(cos, signed_sin)`` ``[B, 1, T, head_dim]`` in
        ``dtype``, for ``apply_rotary``: ``signed_sin`` is the sine with its first half negated."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, B, T, D/2]
        freqs = freqs.gather(0, self.axis_of_band.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        sin = emb.sin()
        sin[..., : sin.shape[-1] // 2].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as ``x * cos + roll(x, D/2) * signed_sin``: the same
    products bit for bit (``-a * s == a * -s``), in three operators instead of six.

    ``x`` ``[B, heads, T, D]``; ``cos``, ``signed_sin`` ``[B, 1, T, D]`` from ``MRoPE``.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=True)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None
        self.decode_kernel: DecodeAttention | None = None  # set by Qwen2LM.use_decode_kernel

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[B, T, hidden]`` -> ``q`` ``[B, heads, T, D]``, ``k``, ``v`` ``[B, kv_heads, T, D]``;
        the rotary embedding is applied to the query and key heads together."""
        batch, length, _ = x.shape
        qkv = self.wqkv(x)
        rotary = (self.n_heads + self.n_kv) * self.head_dim
        qk = qkv[..., :rotary].view(batch, length, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(qk, cos, sin).split([self.n_heads, self.n_kv], dim=1)
        v = qkv[..., rotary:].view(batch, length, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v

    def prefill(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Prompt chunks of several sequences packed along the token axis.

        Args:
            x: ``[1, T, hidden]``, the chunks concatenated.
            cos, sin: ``[1, 1, T, head_dim]`` rotary tables of those tokens.
            parts: per chunk ``(slot, start, length)``: its tokens are positions
                ``start..start+length-1`` of ``slot``'s sequence. The keys/values are written there
                and each chunk attends causally to its slot's cache up to its own positions (a
                chunk with ``start == 0`` attends to itself only).

        Returns:
            ``[1, T, hidden]``.
        """
        q, k, v = self._qkv(x, cos, sin)
        assert self.kv_cache is not None
        outputs, offset = [], 0
        for slot, start, length in parts:
            rows = slice(offset, offset + length)
            qi, ki, vi = q[:, :, rows], k[:, :, rows], v[:, :, rows]
            self.kv_cache.write_prefill(slot, ki, vi, start)
            if start == 0:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:  # earlier chunks come from the cache; query i sees positions <= start + i
                keys, values = self.kv_cache.read(slot, start + length)
                mask = torch.arange(start + length) <= torch.arange(start, start + length)[:, None]
                out = F.scaled_dot_product_attention(
                    qi, keys.to(qi.dtype), values.to(qi.dtype), attn_mask=mask, enable_gqa=True
                )
            outputs.append(out)
            offset += length
        out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        row_slots: torch.Tensor,
        positions: torch.Tensor,
        lengths: list[int],
    ) -> torch.Tensor:
        """``x`` ``[B, 1, hidden]``, row ``b`` writing slot ``row_slots[b]`` (``[B]`` int64) at
        ``positions[b]`` (``[B]`` int64) and attending to the first ``lengths[b]`` cached positions
        of that slot. Rows may share a slot (draft tokens at consecutive positions, speculative
        decoding): every row writes before any attends.

        Attention runs row by row over each row's own length, its query heads grouped by the
        key/value head they share (``[1, kv_heads, heads / kv_heads, head_dim]``, no copy of the
        keys per query head): one masked call over the longest row made every row pay for it. Per
        layer, 2 threads, float32, batch 16 with one row at 1800 positions and the others at
        200-700: 0.62 ms row by row against 1.94 ms as one masked call (one process).
        """
        assert self.kv_cache is not None
        batch = x.shape[0]
        if self.decode_kernel is not None:  # the same steps in one call (Qwen2LM.use_decode_kernel)
            out = torch.empty(batch, self.n_heads * self.head_dim, dtype=torch.float32)
            self.decode_kernel(
                self.wqkv(x).view(batch, -1),
                cos.view(batch, -1),
                sin.view(batch, -1),
                self.kv_cache.k,
                self.kv_cache.v,
                row_slots,
                positions,
                self.n_heads,
                out,
            )
            return self.wo(out.view(batch, 1, -1))
        q, k, v = self._qkv(x, cos, sin)
        keys, values = self.kv_cache.write_decode(row_slots, positions, k, v)
        group = self.n_heads // self.n_kv
        # Decode attention runs in float32: SDPA's bfloat16 kernel for one query row is slower on CPU
        # than upcasting a bfloat16 store (a no-op for a float32 one) and running the float32 one
        # (measured as one masked call at batch 16 and 1500 positions, 2 threads, per layer: 19 ms
        # vs 8 ms cast + 3 ms attention).
        q = q.reshape(x.shape[0], self.n_kv, group, self.head_dim).float()
        rows = [
            F.scaled_dot_product_attention(
                q[b : b + 1], keys[slot : slot + 1, :, :n].float(), values[slot : slot + 1, :, :n].float()
            )
            for b, (slot, n) in enumerate(zip(row_slots.tolist(), lengths, strict=True))
        ]
        out = torch.cat(rows)  # [B, kv_heads, group, head_dim]
        return self.wo(out.to(x.dtype).reshape(x.shape[0], 1, -1))


# Rows of the MLP per call in a prefill, where its linears allow it (``rows_independent``: the fast
# preset's block INT8 layers): the [rows, 2 * 4864] float32 ``w_gate_up`` output (3.6 MiB) stays
# under the mmap threshold the engine pins (engine.memory.MMAP_THRESHOLD_BYTES, 4 MiB), so it is
# reused from the heap; a 512-row chunk's 19 MiB came from a fresh mapping at every layer,
# page-faulted and zeroed by the kernel (a [1394, 9728] output: 12.6 ms fresh, 0.8 ms reused; EPYC,
# 2 threads). The outputs are bit-identical for any chunking there. Other linears run the chunk
# whole: a float GEMM may round otherwise at another row count, per-tensor INT8 scales over the
# rows, and the bfloat16-stored and weight-only layers would rebuild their weight at every call.
MLP_CHUNK_ROWS = 96


class FeedForward(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> ``[..., hidden]``, ``MLP_CHUNK_ROWS`` rows at a time where the
        linears' rows are independent (see ``MLP_CHUNK_ROWS``)."""
        if x.numel() <= MLP_CHUNK_ROWS * x.shape[-1]:  # every decode step
            return self._rows(x)
        if not all(getattr(layer, "rows_independent", False) for layer in (self.w_gate_up, self.w_down)):
            return self._rows(x)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], MLP_CHUNK_ROWS):
            out[start : start + MLP_CHUNK_ROWS] = self._rows(rows[start : start + MLP_CHUNK_ROWS])
        return out.view(x.shape)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate).mul_(up)
        del gate_up, gate, up  # w_down's input alone stays alive through it
        return self.w_down(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)


class Qwen2LM(nn.Module):
    """The decoder. Call ``setup_cache`` once, then ``prefill`` per new sequence and ``decode`` per
    step for all live slots. Both return logits of the last position only (float32)."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        # Built without a random initialization: the model is built on the meta device and its
        # table always comes from the checkpoint or the prepared cache, and initializing a meta
        # table (normal_) imports torch._dynamo, 1.4 s of every start-up.
        self.embed = nn.Embedding.from_pretrained(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = MRoPE(config)
        self._decoder_kernels: DecoderKernels | None = None  # use_decoder_kernels
        self._decoder: BoundDecoder | None = None  # the decode step in one call, where it runs
        self._decoder_modules: tuple[list, list, list] = ([], [], [])  # _bind_decoder: (holders, keys, modules)

    @property
    def decoder_layers(self) -> Iterable[DecoderLayer]:
        """``layers`` as ``DecoderLayer``s (an ``nn.ModuleList`` yields plain modules to a type checker)."""
        return cast("Iterable[DecoderLayer]", self.layers)

    def setup_cache(self, slots: int, max_len: int, dtype: torch.dtype) -> None:
        """Allocate the static KV buffers: ``slots`` sequences of at most ``max_len`` tokens,
        stored in ``dtype`` (see ``KVCache``)."""
        c = self.config
        for layer in self.decoder_layers:
            layer.attention.kv_cache = KVCache(slots, c.num_kv_heads, max_len, c.head_dim, dtype)
        self._bind_decoder()

    def use_decode_kernel(self, kernel: DecodeAttention | None) -> None:
        """Run each decode step's rotary embedding, KV write and attention as one call of ``kernel``
        (``kernels.KernelStatus.decode_attention``: float32 activations and KV buffers only), or
        as PyTorch operators (None, the default). Call it after ``setup_cache``.

        Raises:
            ValueError: a kernel with activations or KV buffers other than float32.
        """
        if kernel is not None and (
            self.dtype != torch.float32
            or any(
                layer.attention.kv_cache is None or layer.attention.kv_cache.dtype != torch.float32
                for layer in self.decoder_layers
            )
        ):
            raise ValueError("the decode attention kernel takes float32 activations and KV buffers")
        for layer in self.decoder_layers:
            layer.attention.decode_kernel = kernel
        self._bind_decoder()

    @property
    def blockwise_decoder(self) -> bool:
        """Whether every decoder linear is block-wise INT8 (the fast preset's language model)."""
        return all(
            isinstance(linear, BlockInt8Linear)
            for layer in self.decoder_layers
            for linear in (
                layer.attention.wqkv,
                layer.attention.wo,
                layer.feed_forward.w_gate_up,
                layer.feed_forward.w_down,
            )
        )

    def use_decoder_kernels(self, kernels: DecoderKernels | None) -> None:
        """While the decode attention kernel is on too (``use_decode_kernel``), run each decode
        step's decoder layers in one call of ``kernels`` (``kernels.KernelStatus.decoder``: the
        block kernel, the decode attention, and the norms and SiLU-gated product in the kernels'
        arithmetic, within a few float32 ulps of PyTorch's operators); or PyTorch's operators
        between the kernels' calls (None, the default). Prefill keeps PyTorch's norms and SiLU
        either way. For block-wise INT8 linears (``quantize.BlockInt8Linear``) and float32 only: the
        fast preset's language model.

        Raises:
            ValueError: activations other than float32, or a decoder linear that is not block-wise INT8.
        """
        if kernels is not None:
            if self.dtype != torch.float32:
                raise ValueError("the decoder kernels take float32 activations")
            if not self.blockwise_decoder:
                raise ValueError("the decoder kernels run block-wise INT8 decoder linears only")
        self._decoder_kernels = kernels
        self._bind_decoder()

    def _bind_decoder(self) -> None:
        """Bind the one-call decode step to the layers' current modules, tensors and caches where the
        decoder kernels and the decode attention kernel are on, every decoder linear is block-wise
        INT8 and every KV cache float32; else drop it (decode then runs the layers one by one).

        Raises:
            ValueError: a tensor the kernels cannot read (``kernels.BoundDecoder``); the step is
                dropped first.
        """
        self._decoder = None
        layers = list(self.decoder_layers)
        kernels = self._decoder_kernels
        if (
            kernels is None
            or not self.blockwise_decoder
            or any(
                layer.attention.decode_kernel is None
                or layer.attention.kv_cache is None
                or layer.attention.kv_cache.dtype != torch.float32
                for layer in layers
            )
        ):
            return

        def block(linear: nn.Module) -> DecoderLayerRefs:
            return [(linear._buffers, name) for name in ("weight_packed", "weight_scale", "bias")]

        refs: list[DecoderLayerRefs] = []
        modules: list[tuple[dict[str, Any], str]] = [(self._modules, "layers")]
        for index, layer in enumerate(layers):  # in kernels.DecoderLayerRefs' order
            attention, ffn = layer.attention, layer.feed_forward
            assert attention.kv_cache is not None
            cache = attention.kv_cache._buffers
            refs.append([(layer.attention_norm._parameters, "weight"), *block(attention.wqkv), *block(attention.wo),
                         (layer.ffn_norm._parameters, "weight"), *block(ffn.w_gate_up), *block(ffn.w_down),
                         (cache, "k"), (cache, "v")])  # fmt: skip
            modules += [(self.layers._modules, str(index)), (attention.__dict__, "decode_kernel")]
            modules += [(layer._modules, name) for name in ("attention_norm", "attention", "ffn_norm", "feed_forward")]
            modules += [(attention._modules, name) for name in ("wqkv", "wo", "kv_cache")]
            modules += [(ffn._modules, name) for name in ("w_gate_up", "w_down")]
        c = self.config
        decoder = kernels.bind(refs, c.num_heads, c.intermediate_size, c.rms_norm_eps)
        holders, keys = (list(t) for t in zip(*modules, strict=True))
        self._decoder_modules = (holders, keys, list(map(operator.getitem, holders, keys)))
        self._decoder = decoder

    def _decoder_current(self) -> bool:
        """Whether the modules the one-call step was bound through are still the model's (the
        tensors in them the step checks itself): ~20 us, loops in C."""
        holders, keys, bound = self._decoder_modules
        return all(map(operator.is_, map(operator.getitem, holders, keys), bound))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` to slot ``dst`` in every layer."""
        for layer in self.decoder_layers:
            assert layer.attention.kv_cache is not None
            layer.attention.kv_cache.move(src, dst, length)

    def release_slot(self, slot: int) -> None:
        """Give slot ``slot``'s cached positions back to the operating system in every layer (see
        ``KVCache.release``); call it once no sequence holds the slot."""
        for layer in self.decoder_layers:
            assert layer.attention.kv_cache is not None
            layer.attention.kv_cache.release(slot)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype."""
        return self.norm.weight.dtype

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (int64, any shape) -> embeddings ``[..., hidden]`` in the activation dtype."""
        return self.embed(ids).to(self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """One whole prompt into ``slot``: ``embeds`` ``[1, T, hidden]``, ``positions``
        ``[3, 1, T]`` -> logits ``[1, vocab]`` of its last token."""
        return self.prefill_chunks([(embeds[0], positions[:, 0], slot, 0)])

    def prefill_chunks(self, chunks: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> torch.Tensor:
        """Prompt chunks of several sequences in one forward (chunked, batched prefill).

        The linears run once over all chunks' tokens; attention runs per chunk against its own
        slot's cache (see ``Attention.prefill``).

        Args:
            chunks: per chunk ``(embeds [T_i, hidden], positions [3, T_i] int64, slot, start)``:
                the prompt embeddings and M-RoPE positions of prompt positions
                ``start..start+T_i-1`` of the sequence in ``slot``. Earlier positions of that
                sequence must already be in the cache.

        Returns:
            Logits ``[len(chunks), vocab]`` float32 of each chunk's last token.
        """
        embeds = torch.cat([c[0] for c in chunks])[None] if len(chunks) > 1 else chunks[0][0][None]
        positions = torch.cat([c[1] for c in chunks], dim=1) if len(chunks) > 1 else chunks[0][1]
        parts = [(slot, start, c.shape[0]) for c, _, slot, start in chunks]
        cos, sin = self.rope(positions[:, None], embeds.dtype)
        h = embeds
        for layer in self.decoder_layers:
            h = h + layer.attention.prefill(layer.attention_norm(h), cos, sin, parts)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        last = torch.tensor(list(itertools.accumulate(length for _, _, length in parts))) - 1
        return self._logits(h[0, last])

    def decode(
        self,
        tokens: torch.Tensor,
        rope_positions: torch.Tensor,
        cache_positions: torch.Tensor,
        row_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step: ``B`` rows of one token each.

        Args:
            tokens: ``[B]`` int64, each row's token (a slot's last token, or a draft token).
            rope_positions: ``[B]`` int64 M-RoPE position (equal on the three axes for text).
            cache_positions: ``[B]`` int64 index in the row's slot's KV buffer to write; the row
                attends to that slot's positions up to it.
            row_slots: ``[B]`` int64, the slot of each row; None: row ``b`` is slot ``b``. Rows may
                share a slot at consecutive positions (speculative decoding's verification). A
                row's logits are those of a step of its token alone, bit for bit, wherever the
                linears' arithmetic does not depend on the row count (the fast preset's block
                kernel; a float32 GEMM may round otherwise at another row count, as in any batch).

        Returns:
            Logits ``[B, vocab]`` float32.
        """
        if row_slots is None:
            row_slots = torch.arange(tokens.shape[0])
        if self._decoder is not None and not self._decoder_current():
            self._bind_decoder()  # a module replaced since: bound again, or dropped where it no longer runs
        if self._decoder is not None:  # the layers in one call (use_decoder_kernels)
            h = self.embed_tokens(tokens)  # [B, hidden], updated in place
            cos, sin = self.rope(rope_positions.view(1, -1, 1).expand(3, -1, 1), h.dtype)
            batch = tokens.shape[0]
            self._decoder(h, cos.view(batch, -1), sin.view(batch, -1), row_slots, cache_positions)
            return self._logits(h)
        h = self.embed_tokens(tokens)[:, None]  # [B, 1, hidden]
        cos, sin = self.rope(rope_positions.view(1, -1, 1).expand(3, -1, 1), h.dtype)
        lengths = (cache_positions + 1).tolist()
        for layer in self.decoder_layers:
            h = h + layer.attention.decode(layer.attention_norm(h), cos, sin, row_slots, cache_positions, lengths)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        return self._logits(h[:, 0])
