"""A chat answer's text as its tokens come: incremental detokenization and stop-string cutting.

``IncrementalText`` turns a growing list of token ids into text deltas whose concatenation is the
decode of the whole list (vLLM's incremental detokenizer scheme): it decodes a short window of ids
(the last emitted ones as context, plus the new ones) and emits what the new ids add; a window that
ends inside a multi-byte character (its decode ends in U+FFFD) is held until the character is whole.

``StopCutter`` holds back the end of the text that could be the start of a stop string, so what was
sent is always a prefix of the answer cut before its first stop string (``before_stop``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText", "StopCutter", "before_stop"]

_REPLACEMENT = "\ufffd"  # what a tokenizer's decode gives for an incomplete UTF-8 sequence


def before_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first of the ``stop`` strings (all of it when none occurs)."""
    return text[: min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))]


class IncrementalText:
    """Text deltas of a growing token sequence.

    Args:
        decode: ids -> text (the tokenizer's decode with the answer's ``skip_special_tokens``).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self._prefix = 0  # ids from here on are decoded for context
        self._read = 0  # ids before this one are emitted

    def feed(self, ids: Sequence[int]) -> str:
        """The text the ids beyond those already emitted add ("" while a character is incomplete).

        Args:
            ids: every token so far (a longer list each call; the same ids at the front).
        """
        if len(ids) <= self._read:
            return ""
        window = list(ids[self._prefix :])
        context = self.decode(window[: self._read - self._prefix])
        text = self.decode(window)
        if len(text) <= len(context) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return text[len(context) :]


class StopCutter:
    """What of a growing answer may be sent: all but a tail that could begin a stop string.

    Args:
        stop: the request's stop strings (none: everything is sent at once).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.text = ""  # the answer so far
        self.sent = 0  # characters of it already released
        self.stopped = False  # a stop string was found: nothing more is released

    def add(self, delta: str) -> str:
        """Append ``delta``; returns what may be sent now."""
        if self.stopped:
            return ""
        self.text += delta
        cut = before_stop(self.text, self.stop)
        if len(cut) < len(self.text):
            self.stopped = True
            return self._release(len(cut))
        held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - held)

    def finish(self, full: str) -> str:
        """The rest of the answer once it is complete (``full``: the decode of every token, the
        text the non-streamed answer holds before its cut)."""
        final = before_stop(full, self.stop)
        rest = final[self.sent :]
        self.sent = len(final)
        return rest

    def _release(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
