"""Draft tokens for speculative decoding, from what a sequence already holds (no draft model).

A decode step may feed a sequence's last token followed by up to ``k`` *draft* tokens; the
scheduler verifies them against the model's own choices (``scheduler.Scheduler``: greedy, every
decoding rule applied position by position) and keeps the longest agreeing prefix plus the model's
next token, so the output is the plain decode's, token for token. Drafts only change how many
decode steps the output takes.

``DraftProposer`` is n-gram lookup ("prompt lookup decoding"): the sequence's last ``n`` tokens
(longest ``n`` first) are looked up in

1. a *reference*: token ids the output is expected to hold, such as the PDF text layer of the block
   a crop shows (``GenerationRequest.draft_text``); the lookup prefers the first occurrence at or
   after where the previous reference draft continued, so a text is followed in order;
2. the sequence's own prompt text and output so far (OTSL tables, number formats and repeated
   structures repeat their own n-grams); the most recent occurrence wins.

The tokens that followed the match are the draft. No match of at least ``min_ngram`` tokens, no
draft: the step is a plain one. A draft costs rows of the step whether it is accepted or not, so its
length adapts per sequence (``record``): it grows by 2 after a draft accepted whole and shrinks by 1
after a rejection (the schedule of transformers' assisted generation), between 1 and the request's
bound.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4  # longest suffix looked up
MIN_NGRAM = 1  # a one-token match drafts too: on the workload's outputs it saved more steps than it cost
FIRST_LENGTH = 2  # draft length before any feedback


class DraftProposer:
    """N-gram drafts for one sequence (see the module docstring).

    Args:
        prompt_text: token ids of the prompt's text (no image pads): the start of the history.
        reference: token ids the output is expected to hold (e.g. the text layer), or empty.
        max_length: the longest draft (the request's ``speculative``); the adaptive length stays
            within 1 and it.
        max_ngram / min_ngram: the suffix lengths looked up, longest first (``1 <= min <= max``).

    Raises:
        ValueError: ngram bounds out of order, or ``max_length`` below 1.
    """

    def __init__(
        self,
        prompt_text: Sequence[int] = (),
        reference: Sequence[int] = (),
        max_length: int = 8,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram bounds must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = max_length
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reference = list(reference)
        # n -> n-gram -> positions of the token that follows it in the reference, ascending
        self._reference_next: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self._sizes()}
        for end in range(1, len(self.reference)):
            for n in self._sizes():
                if end >= n:
                    self._reference_next[n].setdefault(tuple(self.reference[end - n : end]), []).append(end)
        self._cursor = 0  # where the last reference draft continued
        self.length = min(FIRST_LENGTH, max_length)  # the next draft's most tokens (see ``record``)
        self.history: list[int] = list(prompt_text)
        self._output_start = len(self.history)
        # n -> n-gram -> position of the token that followed its latest occurrence in the history
        self._history_next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes()}
        for end in range(1, len(self.history)):
            self._index_history(end)

    def _sizes(self) -> range:
        return range(self.max_ngram, self.min_ngram - 1, -1)

    def _index_history(self, end: int) -> None:
        """Record that ``history[end]`` followed the n-grams ending just before it."""
        for n in self._sizes():
            if end >= n:
                self._history_next[n][tuple(self.history[end - n : end])] = end

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``output``.

        Args:
            output: the sequence's generated tokens so far (this proposer's sequence only: it keeps
                an index of them and expects the same list, grown, on every call).
            k: most tokens to return this step (0 or less: none; the room left in the step, the
                output's bound); fewer while the adaptive ``length`` is lower.

        Returns:
            The draft: ``[]`` when no suffix of ``min_ngram`` to ``max_ngram`` tokens has an earlier
            occurrence with a continuation.
        """
        for token in output[len(self.history) - self._output_start :]:
            self.history.append(token)
            self._index_history(len(self.history) - 1)
        k = min(k, self.length)
        if k <= 0:
            return []
        for n in self._sizes():
            if len(self.history) < n:
                continue
            gram = tuple(self.history[-n:])
            follows = self._reference_next[n].get(gram)
            if follows:
                at = next((p for p in follows if p >= self._cursor), follows[0])
                self._cursor = at + 1
                return self.reference[at : at + k]
            last = self._history_next[n].get(gram)
            if last is not None:
                return self.history[last : last + k]
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt the draft length to how the last draft of ``proposed`` tokens fared (``accepted``
        of them were the model's own choices): +2 when all were, else -1, within 1 and
        ``max_length``."""
        if proposed:
            grown = self.length + 2 if accepted == proposed else self.length - 1
            self.length = max(1, min(self.max_length, grown))
