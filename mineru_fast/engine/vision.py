"""The Qwen2-VL NaViT vision encoder of MinerU2.5, with many images packed into one sequence.

Patches of every image are concatenated, so the linears (patch embedding, qkv, MLP, merger) run
as single large matmuls; attention runs per image (block-diagonal), through SDPA or a bfloat16
attention (``use_attention_kernel``: the own kernel, or SDPA over bfloat16 copies on AMX), none of
which materializes a ``[heads, N, N]`` score matrix. Rotary tables depend only on the grid and the
most recently used ones are cached by grid.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mineru_fast.engine.model import rotate_half

# Rows of the vision MLP per chunk: its [rows, 5120] float32 intermediates (3.75 MiB) stay under the
# mmap threshold the engine pins (engine.memory.MMAP_THRESHOLD_BYTES, 4 MiB), so they are reused
# from the heap instead of mapped and page-faulted afresh at every call. The outputs are
# bit-identical for any chunking (each row's MLP is independent). A layout image's vision pass
# (5476 patches, full-size encoder, per-token INT8, 2 threads, the threshold pinned; 2026-12-02,
# Intel Xeon, three alternated runs): 1024-row chunks with 4-head groups 28.4 / 26.9 / 26.8 s,
# 192 rows with 2-head groups 25.3 / 25.5 / 25.3 s (with glibc's threshold left at 32 MiB both
# take ~23 s: the remaining difference is the layout pass's other [5476, 1280] temporaries).
MLP_CHUNK_ROWS = 192
# Heads per attention call. Each head's attention is its own computation (the same values whatever
# the grouping); groups of 2 of the 16 heads keep the rotated queries and keys, the value copy and
# the output of one call at an eighth of the all-heads size (a layout image: 3.3 MiB each, under
# the pinned mmap threshold, like MLP_CHUNK_ROWS).
ATTENTION_HEAD_GROUP = 2
# Rotary tables kept, most recently used first. Every page repeats the layout grid, while crop
# grids vary with each block's size: an unbounded cache grew with every new crop size over a
# server's life (a table pair is 640 bytes per patch: 3.5 MB for a layout image).
ROPE_CACHE_GRIDS = 32
# What the encoder's blocks time (VisionEncoder.seconds).
VISION_STAGES = ("linears", "attention")


def _clock() -> float:
    """``time.perf_counter()`` for the blocks' timers, 0.0 while ``torch.compile`` traces them
    (a timer is no part of a compiled graph: it would break it)."""
    return 0.0 if torch.compiler.is_compiling() else time.perf_counter()


@dataclass(frozen=True)
class VisionConfig:
    """Hyper-parameters of the vision encoder (from the checkpoint's ``vision_config``)."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, computed in float32 as the reference does, cast back."""
    x32 = x.float()
    return (x32 * cos).addcmul_(rotate_half(x32), sin).to(x.dtype)


class VisionBlock(nn.Module):
    # The CPU class's fast attention (engine.kernels.vision_attention_status().attention), set by
    # VisionEncoder.use_attention_kernel; None: PyTorch's SDPA in the activations' dtype.
    attention_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def __init__(self, config: VisionConfig, seconds: dict[str, float] | None = None) -> None:
        super().__init__()
        # seconds in the linears and in attention, added to (VisionEncoder.seconds)
        self.seconds = seconds if seconds is not None else dict.fromkeys(VISION_STAGES, 0.0)
        dim, hidden = config.embed_dim, config.embed_dim * config.mlp_ratio
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def _count(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to the count of ``stage`` (``self.seconds``); nothing while
        ``torch.compile`` traces (a compiled graph holds no timer)."""
        if not torch.compiler.is_compiling():
            self.seconds[stage] += seconds

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, dim]`` contiguous, the normed patches of one image, with its rotary tables
        ``[1, n, head_dim]`` -> ``[n, dim]``. ``x`` is consumed: the heads' outputs are written
        into its storage (see ``_heads``)."""
        heads = self._heads(x, cos, sin)
        start = _clock()
        out = self.proj(heads)
        self._count("linears", _clock() - start)
        return out

    def _heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention heads' outputs ``[n, dim]``, in ``x``'s storage.

        Once the queries, keys and values are computed ``x`` is not read again, so its storage
        takes the heads' outputs. Where ``qkv`` is packed by head group (``pack_qkv_by_head_group``)
        at most two groups' ``[n, 3 * ATTENTION_HEAD_GROUP * head_dim]`` exist at a time (the next
        one is computed while the last one's names are still bound); otherwise the whole
        ``[n, 3 * dim]`` does, until the last group is done, and is freed before the output
        projection allocates its result (a layout image's 5,476 patches: 10.5 MB per group against
        84 MB of float32 for all the queries, keys and values)."""
        n = x.shape[0]
        out = x.view(n, self.num_heads, -1)  # [n, H, d]
        kernel = self.attention_kernel if x.dtype == torch.float32 else None
        start, attention = _clock(), 0.0
        for h, qkv in zip(range(0, self.num_heads, ATTENTION_HEAD_GROUP), self._qkv_by_head_group(x), strict=True):
            began = _clock()
            q, k, v = qkv.permute(1, 2, 0, 3).unbind(0)  # [G, n, d]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if kernel is not None:  # writes the group's heads into out[:, h : h + G] itself
                kernel(q, k, v, out[:, h : h + q.shape[0]].view(n, -1))
            else:
                # 4-D [1, G, n, d] inputs take SDPA's fused CPU kernel (3-D ones fall back to the math path)
                attended = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
                out[:, h : h + ATTENTION_HEAD_GROUP] = attended.transpose(0, 1)
            attention += _clock() - began
        self._count("attention", attention)
        self._count("linears", _clock() - start - attention)  # the qkv projection
        return out.view(n, -1)

    def _qkv_by_head_group(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """The queries, keys and values of each group of ``ATTENTION_HEAD_GROUP`` heads in turn,
        ``[n, 3, G, head_dim]`` (the last group may be smaller), all computed from ``x`` before
        the first is given."""
        n = x.shape[0]
        if getattr(self.qkv, "row_groups", None) is not None:
            for part in cast(Any, self.qkv).row_group_outputs(x):
                yield part.view(n, 3, ATTENTION_HEAD_GROUP, -1)
            return
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        for h in range(0, self.num_heads, ATTENTION_HEAD_GROUP):
            yield qkv[:, :, h : h + ATTENTION_HEAD_GROUP]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """``x`` ``[N, dim]`` of packed images with ``lengths`` patches each (updated in place and
        returned). Attention runs image by image, as it must (each image attends to itself), and
        so do its linears: a pack's temporaries are then one image's, not ``[N, 3 * dim]``; the
        MLP is row-wise and runs on ``MLP_CHUNK_ROWS`` rows at a time, so its ``[rows, 5120]``
        intermediates stay in cache. Residuals are added in place, each into its own rows."""
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            x[rows].add_(self.attention(self.norm1(x[rows]), cos[:, rows], sin[:, rows]))
            start += n
        linears = 0.0
        for start in range(0, x.shape[0], MLP_CHUNK_ROWS):
            chunk = x[start : start + MLP_CHUNK_ROWS]
            normed = self.norm2(chunk)
            began = _clock()
            h = self.fc1(normed)
            linears += _clock() - began
            gated = h.mul(1.702).sigmoid_().mul_(h)  # quick_gelu(h) = h * sigmoid(1.702 h)
            began = _clock()
            projected = self.fc2(gated)
            linears += _clock() - began
            chunk.add_(projected)
        self._count("linears", linears)
        return x


def qkv_row_groups(config: VisionConfig) -> torch.Tensor:
    """``[num_heads / ATTENTION_HEAD_GROUP, 3 * ATTENTION_HEAD_GROUP * head_dim]`` int64: the
    output rows of a block's ``qkv`` projection (``[3, num_heads, head_dim]`` order, as the
    checkpoint stores them) that hold each head group's queries, keys and values, in
    ``[3, ATTENTION_HEAD_GROUP, head_dim]`` order.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``ATTENTION_HEAD_GROUP``.
    """
    heads, head_dim = config.num_heads, config.head_dim
    if heads % ATTENTION_HEAD_GROUP:
        raise ValueError(f"{heads} heads do not split into groups of {ATTENTION_HEAD_GROUP}")
    rows = torch.arange(3 * heads * head_dim).view(3, heads // ATTENTION_HEAD_GROUP, ATTENTION_HEAD_GROUP, head_dim)
    return rows.transpose(0, 1).reshape(heads // ATTENTION_HEAD_GROUP, -1)


def pack_qkv_by_head_group(layer: nn.Module, config: VisionConfig) -> None:
    """Pack a block's prepared ``qkv`` layer by head group where it can be (an INT8 layer with
    ``pack_row_groups``, ``quantize.OneDnnInt8Linear``, and heads that split into groups), so
    attention never holds all heads' queries, keys and values at once (``VisionBlock._heads``);
    any other layer is left as it is."""
    if hasattr(layer, "pack_row_groups") and config.num_heads % ATTENTION_HEAD_GROUP == 0:
        cast(Any, layer).pack_row_groups(qkv_row_groups(config))


class PatchMerger(nn.Module):
    """LayerNorm, then each 2x2 group of neighbouring patches -> one LM token (MLP with GELU)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.embed_dim * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, config.out_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.merged))))


class VisionEncoder(nn.Module):
    """Pixels of packed images -> LM embeddings.

    ``forward(pixel_values, grids)``: ``pixel_values`` ``[N, 3*2*14*14]`` as the Qwen2-VL image
    processor lays them out (patches in 2x2 merge-window order), ``grids`` the ``(t, h, w)`` patch
    grid of each image; returns ``[N / 4, out_hidden_size]``.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        # Seconds the blocks spent in their linears (qkv, proj, fc1, fc2) and in attention (rotary
        # embedding, the heads' copies and the attention itself) so far; the rest of a pass is
        # norms, activations, residual additions, the patch embedding and the merger. Read by
        # ``FastEngine.stage_seconds``.
        self.seconds = dict.fromkeys(VISION_STAGES, 0.0)
        self.patch_embed = nn.Linear(config.patch_dim, config.embed_dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config, self.seconds) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        half = config.head_dim // 2  # h and w each rotate a quarter of the head (cos/sin pairs)
        # A plain float32 CPU attribute, not a buffer: it must not follow the weights' dtype.
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half)
        )
        self._rope_cache: OrderedDict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def use_attention_kernel(
        self, kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None
    ) -> None:
        """Run every block's attention on ``kernel`` (``engine.kernels.AttentionStatus.attention``)
        in float32 precision, or on PyTorch's SDPA (None)."""
        for block in self.blocks:
            cast(VisionBlock, block).attention_kernel = kernel

    def rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, head_dim]`` float32 of one image grid, in merge-window order (the
        last ``ROPE_CACHE_GRIDS`` grids' tables are cached)."""
        if grid in self._rope_cache:
            self._rope_cache.move_to_end(grid)
        else:
            t, h, w = grid
            m = self.config.spatial_merge_size
            hpos = (
                torch.arange(h, device="cpu")
                .view(h // m, m, 1, 1)
                .expand(h // m, m, w // m, m)
                .transpose(1, 2)
                .flatten()
            )
            wpos = (
                torch.arange(w, device="cpu")
                .view(1, 1, w // m, m)
                .expand(h // m, m, w // m, m)
                .transpose(1, 2)
                .flatten()
            )
            freqs = torch.cat([hpos[:, None] * self.inv_freq, wpos[:, None] * self.inv_freq], dim=-1).repeat(t, 1)
            emb = torch.cat([freqs, freqs], dim=-1)
            self._rope_cache[grid] = (emb.cos(), emb.sin())
            if len(self._rope_cache) > ROPE_CACHE_GRIDS:
                self._rope_cache.popitem(last=False)
        return self._rope_cache[grid]

    def _embed(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Patch embeddings ``[N, dim]``, rotary tables ``[1, N, head_dim]`` and per-image lengths."""
        lengths = [t * h * w for t, h, w in grids]
        tables = [self.rotary(g) for g in grids]
        cos = torch.cat([c for c, _ in tables]) if len(tables) > 1 else tables[0][0]
        sin = torch.cat([s for _, s in tables]) if len(tables) > 1 else tables[0][1]
        first = cast(VisionBlock, self.blocks[0])
        x = self.patch_embed(pixel_values.to(first.norm1.weight.dtype))  # norms are never quantized
        return x, cos[None], sin[None], lengths  # tables broadcast over heads

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x, cos, sin, lengths = self._embed(pixel_values, grids)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def stepwise(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> Generator[None, None, torch.Tensor]:
        """``forward`` split at block boundaries, so a scheduler can interleave other work.

        A generator: each ``next()`` runs the patch embedding or one block and yields; the last one
        runs the merger and raises ``StopIteration`` whose ``value`` is the output ``forward`` gives
        (the same operations in the same order, so bit-identical). The pixels are let go of once
        embedded: when the caller keeps no reference, they are freed for the rest of the pass.
        """
        x, cos, sin, lengths = self._embed(pixel_values, grids)
        del pixel_values
        for block in self.blocks:
            yield
            x = block(x, cos, sin, lengths)
        yield
        return self.merger(x)
