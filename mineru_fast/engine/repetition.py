"""Loop detection for free-running sequences (the fast engine's repetition guard).

With MinerU's no-repeat-n-gram rule (n = 100) a looping model cannot repeat any 100-token run,
so a loop never looks like "one token again and again": the model cycles through a handful of
tokens and is pushed off the cycle by one banned token about every 100 steps, then falls back into
it. What stays true is near-periodicity: over the last few hundred tokens, almost every token equals
the token one period earlier. Real outputs (prose, numeric tables in OTSL, LaTeX) do not: their
structure tokens repeat with the row length but the cell contents differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["loop_period"]


def loop_period(tokens: Sequence[int], window: int, min_match: float = 0.9) -> int | None:
    """The period of a loop at the end of ``tokens``, or None.

    A period ``p`` (1 <= p <= window / 2) is a loop when, over the last ``window`` tokens,
    ``tokens[i] == tokens[i - p]`` holds for at least ``min_match`` of the positions compared.

    Args:
        tokens: generated token ids.
        window: how many of the last tokens to examine; fewer tokens than this is never a loop.
        min_match: the fraction of positions that must repeat (0.9: a 5-token cycle broken by the
            n-gram ban once per ~100 tokens still matches ~98%).

    Returns:
        The smallest looping period, or None.
    """
    if window < 2 or len(tokens) < window:
        return None
    recent = np.asarray(tokens[-window:])
    for period in range(1, window // 2 + 1):
        if np.count_nonzero(recent[period:] == recent[:-period]) >= min_match * (window - period):
            return period
    return None
