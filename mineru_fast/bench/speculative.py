"""Speculative decoding's draft acceptance per block type on a replayed workload.

With the trace's real output forced as the model's choices, which drafts the scheduler accepts
depends on the tokens alone, not on the model: this replays every request of the workload through
``engine.speculative.DraftProposer`` the way ``engine.scheduler.Scheduler`` verifies a sequence
decoding alone (its drafts bounded by the request's ``max_new_tokens`` and ``k``, the draft length
adapted after each step). The decode steps it counts are those the engine takes at batch 1
(tests/test_speculative.py checks the engine's own counts against the same relation).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from mineru_fast.engine.preprocess import Preprocessor
from mineru_fast.engine.speculative import DraftProposer


def replay_acceptance(tokens: list[int], prompt_text: list[int], k: int, max_new_tokens: int) -> tuple[int, int, int]:
    """One forced output decoded with drafts: ``(decode_steps, proposed, accepted)``.

    Args:
        tokens: the output's token ids (end token included), the model's choices.
        prompt_text: the prompt's text token ids (the proposer's history before the output).
        k: most draft tokens a step verifies.
        max_new_tokens: the request's bound (drafts stay within it, as the scheduler's do: a
            draft may run past the output's end, which the model's end token then rejects).
    """
    proposer = DraftProposer(prompt_text, max_length=k)
    out, steps, proposed, accepted = tokens[:1], 0, 0, 0
    while len(out) < len(tokens):
        draft = proposer.propose(out, min(k, max_new_tokens - len(out) - 1))
        rest = tokens[len(out) :]
        pairs = list(zip(draft, rest, strict=False))
        n = next((i for i, (d, t) in enumerate(pairs) if d != t), len(pairs))
        proposer.record(len(draft), n)
        steps, proposed, accepted = steps + 1, proposed + len(draft), accepted + n
        out = out + rest[: n + 1]
    return steps, proposed, accepted


def acceptance_by_type(
    requests: Iterable[tuple[str, str, str, int]], preprocessor: Preprocessor, k: int
) -> dict[str, dict[str, float]]:
    """Per block type, over ``(type, prompt, forced output, max_new_tokens)``: output ``tokens``, plain
    ``plain_steps`` and speculative ``decode_steps``, ``proposed`` and ``accepted`` drafts, and the
    ratios ``acceptance`` (accepted / proposed) and ``steps_ratio`` (decode steps / plain steps).

    ``preprocessor``: the checkpoint's; outputs are tokenized as the engine forces them
    (``forced_ids``), prompts as the scheduler gives them to the proposer (``text_ids``).
    """
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for kind, prompt, output, bound in requests:
        tokens = preprocessor.forced_ids(output)
        steps, proposed, accepted = replay_acceptance(tokens, preprocessor.text_ids(prompt), k, bound)
        g = groups[kind]
        for i, value in enumerate((len(tokens), len(tokens) - 1, steps, proposed, accepted)):
            g[i] += value
    return {
        kind: {
            "tokens": t,
            "plain_steps": plain,
            "decode_steps": steps,
            "proposed": p,
            "accepted": a,
            "acceptance": a / max(1, p),
            "steps_ratio": steps / max(1, plain),
        }
        for kind, (t, plain, steps, p, a) in sorted(groups.items())
    }
