"""Static KV buffers: one preallocated ``[slots, kv_heads, max_len, head_dim]`` pair per layer."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one decoder layer for ``slots`` concurrent sequences.

    Each sequence owns a slot and writes its keys/values in place at its own positions; nothing
    is ever reallocated or concatenated.

    Args:
        slots: concurrent sequences (the decode batch width).
        kv_heads: key/value heads (2 for MinerU2.5).
        max_len: longest sequence (prompt + generated tokens) a slot can hold.
        head_dim: per-head width (64 for MinerU2.5).
        dtype: storage dtype (the activation dtype).
    """

    def __init__(self, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (slots, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write_prefill(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's keys/values ``[1, kv_heads, T, head_dim]`` at positions ``0..T-1``."""
        length = k.shape[2]
        self.k[slot, :, :length] = k[0]
        self.v[slot, :, :length] = v[0]

    def write_decode(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new key/value per slot and return the slots' keys/values for attention.

        Args:
            positions: ``[B]`` int64, where row ``b`` (slot ``b``) writes.
            k, v: ``[B, kv_heads, 1, head_dim]``.

        Returns:
            ``(keys, values)``, views ``[B, kv_heads, L, head_dim]`` with ``L = max(positions) + 1``.
        """
        rows = torch.arange(k.shape[0])
        self.k[rows, :, positions] = k[:, :, 0]
        self.v[rows, :, positions] = v[:, :, 0]
        length = int(positions.max()) + 1
        return self.k[: k.shape[0], :, :length], self.v[: k.shape[0], :, :length]
