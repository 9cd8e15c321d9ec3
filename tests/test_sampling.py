"""Tier 1: batched decoding rules against brute-force definitions and transformers."""

from __future__ import annotations

import random

import torch
from transformers import NoRepeatNGramLogitsProcessor

from mineru_fast.engine.sampling import BatchLogitsProcessor, NGramBlocker, log_normalizer
from mineru_fast.protocol.spec import SamplingParams


def brute_force_banned(tokens: list[int], n: int) -> set[int]:
    """Tokens t such that tokens[-(n-1):] + [t] already occurs as an n-gram."""
    if len(tokens) < n - 1:
        return set()
    tail = tokens[len(tokens) - (n - 1) :]
    return {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i : i + n - 1] == tail}


def test_ngram_blocker_matches_brute_force_on_repetitive_sequences():
    rng = random.Random(0)
    for n in (1, 2, 3, 5):
        blocker, tokens = NGramBlocker(n), []
        for _ in range(300):
            assert blocker.banned() == brute_force_banned(tokens, n)
            token = rng.choice([1, 2, 3])  # tiny alphabet: many repeats
            blocker.append(token)
            tokens.append(token)


def test_ngram_blocker_agrees_with_transformers_on_generated_tokens():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(200)]
    n, vocab = 4, 6
    blocker = NGramBlocker(n)
    reference = NoRepeatNGramLogitsProcessor(n)
    for step in range(len(tokens)):
        scores = reference(torch.tensor([tokens[:step]]), torch.zeros(1, vocab))
        assert blocker.banned() == set(torch.nonzero(scores[0] == -torch.inf).flatten().tolist())
        blocker.append(tokens[step])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, no_repeat_ngram_size=0)
    rules = BatchLogitsProcessor([params, SamplingParams(no_repeat_ngram_size=0)], [None, None], vocab_size=5)
    for tokens in ([2, 0], [2, 0], [3, 0]):  # row 0 generates 2, 2, 3; row 1 generates 0, 0, 0
        rules.observe(tokens)
    logits = rules(torch.zeros(2, 5))
    assert torch.allclose(logits[0], torch.tensor([0.0, 0.0, -1.10, -1.05, 0.0]))
    assert torch.equal(logits[1], torch.zeros(5))  # no penalties configured on row 1


def test_penalties_on_the_generated_tokens_alone_equal_the_whole_vocabulary_formula():
    """The penalties touch only the tokens a row generated; the result equals
    ``logits - (frequency * counts + presence * [counts > 0])`` over the whole row, bit for bit,
    for every row subset and after a row moves (continuous batching)."""
    torch.manual_seed(0)
    vocab = 1000
    params = [
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, no_repeat_ngram_size=0),
        SamplingParams(presence_penalty=-0.7, frequency_penalty=0.3, no_repeat_ngram_size=0),
        SamplingParams(no_repeat_ngram_size=0),
        SamplingParams(presence_penalty=0.0, frequency_penalty=-1.5, no_repeat_ngram_size=0),
    ]
    rules = BatchLogitsProcessor(params, [None] * 4, vocab_size=vocab)
    history = torch.zeros(4, vocab)
    for _ in range(60):
        tokens = torch.randint(0, 40, (4,)).tolist()  # few distinct ids: counts above 1
        rules.observe(tokens)
        history[torch.arange(4), torch.tensor(tokens)] += 1.0
    presence = torch.tensor([[p.presence_penalty] for p in params])
    frequency = torch.tensor([[p.frequency_penalty] for p in params])
    for rows in (None, [2, 0], [3], [1, 3, 0]):
        picked = list(range(4)) if rows is None else rows
        logits = torch.randn(len(picked), vocab) * 5
        expected = logits - (frequency[picked] * history[picked] + presence[picked] * (history[picked] > 0))
        assert torch.equal(rules(logits.clone(), rows=rows), expected), rows
    rules.move_row(1, 2)
    logits = torch.randn(1, vocab)
    expected = logits - (frequency[1] * history[1] + presence[1] * (history[1] > 0))
    assert torch.equal(rules(logits.clone(), rows=[2]), expected)


def test_forcing_overrides_bans_and_then_releases():
    params = SamplingParams(no_repeat_ngram_size=1)  # n=1 bans every generated token
    rules = BatchLogitsProcessor([params], [[4, 4]], vocab_size=6)
    for _ in range(2):
        logits = rules(torch.randn(1, 6))
        assert int(logits.argmax()) == 4 and torch.isinf(logits).sum() == 5
        rules.observe([4])
    free = rules(torch.zeros(1, 6))
    assert free[0, 4] == -torch.inf and torch.isinf(free).sum() == 1


def test_reset_row_clears_history():
    rules = BatchLogitsProcessor([SamplingParams(presence_penalty=2.0)], [None], vocab_size=3)
    rules.observe([1])
    rules.reset_row(0, SamplingParams(), None)
    assert torch.equal(rules(torch.zeros(1, 3)), torch.zeros(1, 3))


def test_repetition_penalty_covers_prompt_and_output_like_transformers():
    """vLLM's and transformers' repetition penalty: every token of the prompt or the output so far
    has its logit divided by the penalty when positive, multiplied when negative."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, generated = [3, 7, 7, 1], [5, 3]
    params = SamplingParams(repetition_penalty=1.3, no_repeat_ngram_size=0)
    rules = BatchLogitsProcessor([params], [None], vocab_size=10)
    rules.reset_row(0, params, None, torch.tensor(prompt))
    rules.observe([generated[0]])
    rules.observe([generated[1]])
    scores = torch.linspace(-2, 2, 10)[None]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), scores.clone())
    assert torch.allclose(rules(scores.clone()), expected)
    plain = BatchLogitsProcessor([SamplingParams(no_repeat_ngram_size=0)], [None], vocab_size=10)
    assert torch.equal(plain(scores.clone()), scores)


def test_min_new_tokens_bans_the_end_tokens_until_reached():
    params = SamplingParams(min_new_tokens=2, max_new_tokens=5, no_repeat_ngram_size=0)
    rules = BatchLogitsProcessor([params], [None], vocab_size=6, end_ids=[5])
    end_first = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    for _ in range(2):
        assert int(rules(end_first.clone()).argmax()) != 5
        rules.observe([1])
    assert int(rules(end_first.clone()).argmax()) == 5


def test_the_log_normalizer_is_logsumexp_bit_for_bit():
    """``log_normalizer`` skips denormal terms: the same bits as ``torch.logsumexp`` on rows of
    MinerU2.5's vocabulary size whose spread puts many terms below float32's normal range (the
    model's logits do), on narrow rows, at every batch width, with infinite entries too."""
    generator = torch.Generator().manual_seed(0)
    for spread in (1.0, 5.0, 20.0, 40.0, 100.0):
        for rows in (1, 2, 7, 16):
            logits = torch.randn(rows, 151936, generator=generator) * spread
            assert torch.equal(log_normalizer(logits), torch.logsumexp(logits, dim=-1)), (spread, rows)
    logits = torch.randn(4, 1000, generator=generator) * 50
    logits[0, :500] = float("-inf")  # a row partly masked
    logits[1, 3] = float("inf")  # an infinite maximum
    logits[2, 7] = float("nan")
    expected = torch.logsumexp(logits, dim=-1)
    got = log_normalizer(logits)
    assert torch.equal(got[[0, 1, 3]], expected[[0, 1, 3]]) and got[2].isnan() and expected[2].isnan()
