"""Greedy decoding rules as batched tensor code, shared by every engine.

For each sequence (row) of a batch: presence and frequency penalties over its *generated* tokens
(OpenAI/vLLM semantics: ``logit -= presence * [count > 0] + frequency * count``), a
multiplicative repetition penalty over its prompt and generated tokens (vLLM semantics; off at
1.0), a ban on tokens that would repeat an n-gram of its generated tokens, a ban on the end tokens
before ``min_new_tokens``, and, in replay, forcing of a known token. Apart from the repetition
penalty, the prompt never counts. ``transformers`` has no presence/frequency penalty and its
no-repeat-n-gram looks at the prompt too, hence this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mineru_fast.protocol.spec import SamplingParams

# exp(-80) = 1.8e-35 is a normal float32 (the smallest is 1.2e-38); a term below it cannot change a
# sum that holds exp(0) = 1, the row's maximum.
_LOWEST_EXPONENT = -80.0


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of each row of ``logits`` ``[B, vocab]`` float32 -> ``[B]``: what
    ``torch.logsumexp(logits, -1)`` gives, without its denormal arithmetic.

    The terms ``exp(x - max)`` of logits more than 87 below the row's maximum are denormal, and
    summing them takes microcode assists on x86: a decode row of MinerU2.5's 151,936 logits, whose
    spread is wider than that, took 0.75 ms in ``torch.logsumexp`` against 0.09 ms without them (2
    threads, AMD EPYC, 2026-12-05). Those terms are raised to ``exp(-80)`` here, in the same
    summation, below the last bit of a sum that holds the maximum's ``exp(0) = 1``, so the result is
    ``torch.logsumexp``'s bit for bit (tests/test_sampling.py), infinite maxima included (as
    there, an infinite maximum is taken as 0 before the exponentials).
    """
    maxima = logits.amax(dim=-1, keepdim=True)
    maxima = maxima.masked_fill(maxima.isinf(), 0.0)
    terms = (logits - maxima).clamp_(min=_LOWEST_EXPONENT).exp_()
    return terms.sum(dim=-1).log_() + maxima[:, 0]


class NGramBlocker:
    """Incremental no-repeat-n-gram bookkeeping for one sequence.

    ``banned()`` returns the tokens that, appended now, would complete an n-gram already present
    in the generated tokens. Cost per step: one tuple of n-1 ints hashed, O(1) amortized.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], set[int]] = {}

    def append(self, token: int) -> None:
        self.tokens.append(token)
        if self.n and len(self.tokens) >= self.n:
            prefix = tuple(self.tokens[-self.n : -1])
            self._next.setdefault(prefix, set()).add(token)

    def banned(self) -> set[int]:
        if not self.n or len(self.tokens) < self.n - 1:
            return set()
        prefix = tuple(self.tokens[len(self.tokens) - (self.n - 1) :])
        return self._next.get(prefix, set())


class BatchLogitsProcessor:
    """Decoding rules of a batch of sequences, each with its own ``SamplingParams``.

    Call it on each step's logits (``[B, V]`` float32, modified in place), pick ``argmax``, then
    ``observe`` the chosen tokens. Rows can be replaced (continuous batching) with ``reset_row``.

    Args:
        params: one ``SamplingParams`` per row.
        forced: per row, the token ids replay must produce (or None for free decoding).
        vocab_size: logits width V.
        end_ids: the end-of-output token ids (banned before a row's ``min_new_tokens``).
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        forced: Sequence[list[int] | None],
        vocab_size: int,
        end_ids: Sequence[int] = (),
    ) -> None:
        batch = len(params)
        self.vocab_size = vocab_size
        self.counts = torch.zeros(batch, vocab_size, dtype=torch.float32)
        self.presence = torch.zeros(batch, 1, dtype=torch.float32)
        self.frequency = torch.zeros(batch, 1, dtype=torch.float32)
        self.repetition = torch.ones(batch, 1, dtype=torch.float32)
        self.end_ids = list(end_ids)
        self.min_new = [0] * batch
        self.in_prompt = torch.zeros(batch, vocab_size, dtype=torch.bool)
        self.blockers: list[NGramBlocker] = [NGramBlocker(0)] * batch
        self.forced: list[list[int] | None] = [None] * batch
        self.seen: list[set[int]] = [set() for _ in range(batch)]  # generated token ids, per row
        self.penalized = [False] * batch  # the row has a presence or frequency penalty
        for row, (p, f) in enumerate(zip(params, forced, strict=True)):
            self.reset_row(row, p, f)

    def reset_row(
        self, row: int, params: SamplingParams, forced: list[int] | None, prompt_ids: torch.Tensor | None = None
    ) -> None:
        """Start a new sequence in ``row``: clear its history and set its rules.

        Args:
            prompt_ids: the prompt's token ids (int64), needed only by a repetition penalty.
        """
        self.counts[row].zero_()
        self.seen[row] = set()
        self.penalized[row] = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.presence[row, 0] = params.presence_penalty
        self.frequency[row, 0] = params.frequency_penalty
        self.repetition[row, 0] = params.repetition_penalty
        self.min_new[row] = params.min_new_tokens
        self.in_prompt[row].zero_()
        if params.repetition_penalty != 1.0 and prompt_ids is not None:
            self.in_prompt[row, prompt_ids] = True
        self.blockers[row] = NGramBlocker(params.no_repeat_ngram_size)
        self.forced[row] = forced

    def move_row(self, src: int, dst: int) -> None:
        """Move row ``src``'s sequence (rules and history) to row ``dst``; ``src`` is left stale
        until its next ``reset_row``."""
        for table in (self.counts, self.presence, self.frequency, self.repetition, self.in_prompt):
            table[dst] = table[src]
        self.min_new[dst], self.forced[dst] = self.min_new[src], self.forced[src]
        self.seen[dst], self.penalized[dst] = self.seen[src], self.penalized[src]
        self.blockers[dst] = self.blockers[src]

    def __call__(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Apply penalties, n-gram bans and forcing to ``logits`` ``[B, V]`` (float32) in place.

        Logits row ``i`` belongs to sequence row ``rows[i]`` (default: row ``i``).
        """
        select: slice | torch.Tensor
        if rows is None:
            rows = range(logits.shape[0])
            select = slice(0, logits.shape[0])
        else:
            select = torch.tensor(list(rows))
        repetition = self.repetition[select]
        if bool((repetition != 1.0).any()):  # first, as vLLM does
            seen = (self.counts[select] > 0) | self.in_prompt[select]
            penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits.copy_(torch.where(seen, penalized, logits))
        for i, row in enumerate(rows):
            generated = self.seen[row]
            if generated and self.penalized[row]:
                # Only the generated tokens' logits change (presence * [count > 0] + frequency * count
                # is 0 elsewhere): the same float32 steps as over the whole row, on len(seen) of V.
                ids = torch.tensor(sorted(generated))
                logits[i, ids] -= self.frequency[row] * self.counts[row, ids] + self.presence[row]
            blocker = self.blockers[row]
            banned = blocker.banned()
            if banned:
                logits[i, list(banned)] = -torch.inf
            if len(blocker.tokens) < self.min_new[row] and self.end_ids:
                logits[i, self.end_ids] = -torch.inf
            forced = self.forced[row]
            if forced is not None:
                step = len(blocker.tokens)
                if step < len(forced):
                    logits[i].fill_(-torch.inf)
                    logits[i, forced[step]] = 0.0
        return logits

    def observe(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """Record the token each of ``rows`` (default ``0..len(tokens)-1``) generated this step."""
        for row, token in zip(range(len(tokens)) if rows is None else rows, tokens, strict=True):
            self.blockers[row].append(token)
            self.counts[row, token] += 1.0
            self.seen[row].add(token)
