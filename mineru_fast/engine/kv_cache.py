"""Static KV buffers: one preallocated ``[slots, kv_heads, max_len, head_dim]`` pair per layer.

The buffers live in anonymous memory maps: the whole size is reserved at construction, and the
operating system commits (and zero-fills) a page only when a sequence first writes into it. A
layout pass therefore costs the memory of the positions it uses, not of ``slots x max_len``; the
resident size grows towards the reservation only as long sequences occupy more slots, and a slot
whose sequence has ended or moved is given back (``release``).
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)


_release_refused = False  # the kernel refused MADV_REMOVE once: KVCache.release stops trying


def _reserved_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero tensor backed by an anonymous memory map (pages committed on first write).

    Returns the tensor and the map, which must outlive it.
    """
    count = math.prod(shape)
    # Shared and anonymous: zero-filled by the OS, committed lazily, and a mapping of its own (a
    # private one may be merged with the allocator's neighbouring maps, and then /proc/self/smaps
    # cannot tell the KV buffers' resident size apart: engine.memory.resident_bytes).
    region = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape), region


class KVCache(nn.Module):
    """Keys and values of one decoder layer for ``slots`` concurrent sequences.

    Each sequence owns a slot and writes its keys/values in place at its own positions; nothing
    is ever reallocated or concatenated. Unwritten positions read as zeros.

    Args:
        slots: concurrent sequences (the decode batch width).
        kv_heads: key/value heads (2 for MinerU2.5).
        max_len: longest sequence (prompt + generated tokens) a slot can hold.
        head_dim: per-head width (64 for MinerU2.5).
        dtype: storage dtype (the activation dtype, or bfloat16 to halve the buffers).
    """

    k: torch.Tensor  # buffers [slots, kv_heads, max_len, head_dim]
    v: torch.Tensor

    def __init__(self, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (slots, kv_heads, max_len, head_dim)
        k, self._k_region = _reserved_zeros(shape, dtype)
        v, self._v_region = _reserved_zeros(shape, dtype)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def write_prefill(self, slot: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store prompt keys/values ``[1, kv_heads, T, head_dim]`` at positions
        ``start..start+T-1`` of ``slot`` (cast to the storage dtype)."""
        end = start + k.shape[2]
        self.k[slot, :, start:end] = k[0]
        self.v[slot, :, start:end] = v[0]

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[1, kv_heads, length, head_dim]`` of ``slot``'s first ``length`` positions."""
        return self.k[slot : slot + 1, :, :length], self.v[slot : slot + 1, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (``src`` keeps
        its now stale copy)."""
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]

    def release(self, slot: int) -> None:
        """Give ``slot``'s committed memory back to the operating system (``madvise`` with
        ``MADV_REMOVE``, which frees a shared map's pages, on the whole pages inside the slot's
        part of both maps): those positions read as zeros again and are committed anew when next
        written. A slot a finished or moved sequence leaves otherwise stays committed up to the
        longest sequence it ever held (the layout pass's ~1,800 positions: 44 MB at MinerU2.5's
        size in float32). A no-op where the platform has no ``MADV_REMOVE`` (it is Linux's), and
        from the first refusal on where the kernel refuses it (logged once)."""
        global _release_refused
        if _release_refused or not hasattr(mmap, "MADV_REMOVE"):
            return
        size = self.k[slot].numel() * self.k.element_size()
        # Only whole pages: a page shared with a neighbouring slot keeps its contents.
        start = -(-slot * size // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (slot + 1) * size // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            try:
                for region in (self._k_region, self._v_region):
                    region.madvise(mmap.MADV_REMOVE, start, end - start)
            except OSError as exc:  # e.g. a sandboxed kernel without it: slots then stay committed
                _release_refused = True
                logger.warning("KV slots are not released (madvise MADV_REMOVE: %s)", exc)

    def write_decode(
        self, row_slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new key/value per row and return the whole buffers for attention.

        Args:
            row_slots: ``[B]`` int64, the slot row ``b`` writes (rows may share a slot at distinct
                positions).
            positions: ``[B]`` int64, where row ``b`` writes.
            k, v: ``[B, kv_heads, 1, head_dim]`` (cast to the storage dtype).

        Returns:
            ``(keys, values)``: the buffers ``[slots, kv_heads, max_len, head_dim]`` in the storage
            dtype, every row's key/value written.
        """
        self.k[row_slots, :, positions] = k[:, :, 0].to(self.dtype)
        self.v[row_slots, :, positions] = v[:, :, 0].to(self.dtype)
        return self.k, self.v
