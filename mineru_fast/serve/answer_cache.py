"""Finished chat answers kept for identical re-sends, bounded in entries and bytes.

MinerU's client re-sends a request after its own time-out; when the first try's generation has
already finished, the re-send is answered from here instead of decoding the same tokens again
(``ChatAdmission.join``). Only whole answers are kept (``finish_reason`` ``stop``, ``length`` or
``repetition``); the least recently used go first once either bound is passed.
"""

from __future__ import annotations

from collections import OrderedDict

from mineru_fast.engine.base import GenerationResult

KEPT_REASONS = ("stop", "length", "repetition")
ENTRY_OVERHEAD = 256  # bytes counted per entry beyond its text, token ids and log-probabilities


def answer_bytes(result: GenerationResult) -> int:
    """What an answer is counted as (bytes): its UTF-8 text, 8 per token id and per
    log-probability, and ``ENTRY_OVERHEAD``."""
    return len(result.text.encode()) + 8 * len(result.token_ids) + 8 * len(result.logprobs or ()) + ENTRY_OVERHEAD


class AnswerCache:
    """A least-recently-used map of twin keys (``ChatGeneration.key``) to finished answers.

    Args:
        max_entries: most answers kept (0 disables the cache).
        max_bytes: most ``answer_bytes`` kept in all; a larger answer alone is not kept.

    Raises:
        ValueError: a negative bound.
    """

    def __init__(self, max_entries: int = 512, max_bytes: int = 32 << 20) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"cache bounds must be >= 0, got {max_entries} entries, {max_bytes} bytes")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._answers: OrderedDict[str, tuple[GenerationResult, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: str) -> GenerationResult | None:
        """The answer of ``key`` (now the most recently used), or None."""
        entry = self._answers.get(key)
        if entry is None:
            return None
        self._answers.move_to_end(key)
        return entry[0]

    def put(self, key: str, result: GenerationResult) -> None:
        """Keep ``result`` for ``key`` if it is a whole answer that fits, dropping the least
        recently used ones beyond the bounds."""
        size = answer_bytes(result)
        if result.finish_reason not in KEPT_REASONS or size > self.max_bytes or self.max_entries == 0:
            return
        old = self._answers.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._answers[key] = (result, size)
        self.bytes += size
        while len(self._answers) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._answers.popitem(last=False)
            self.bytes -= dropped
