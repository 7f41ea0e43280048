"""The rejection rule, enumerated exactly in float64: the tokens that come out are distributed as the target's.

Target p(. | prefix) and draft q(. | prefix) are random tables over a vocabulary of <= 8. A
speculative step drafts d1..dk (from q, or deterministically), keeps each with
accept_probability, replaces the first rejected one with a draw from residual_distribution, or
adds a bonus draw from p when all are kept. Continuing with the target up to k + 1 tokens, every
sequence's probability must equal the target's own chain probability: summed over every path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.speculative.rejection import accept_probability, residual_distribution, verify_draft


class Tables:
    """Random conditional distributions, one per prefix, made on first use (float64)."""

    def __init__(self, vocab: int, seed: int, peaked: bool = False) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)
        self.peaked = peaked
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:  # float64 [vocab]
        if prefix not in self.rows:
            logits = torch.randn(self.vocab, generator=self.generator, dtype=torch.float64) * (3.0 if self.peaked else 1.0)
            if torch.rand((), generator=self.generator) < 0.3:  # some rows have tokens of probability 0
                logits[torch.randint(self.vocab, (2,), generator=self.generator)] = float("-inf")
            self.rows[prefix] = torch.softmax(logits, dim=0)
        return self.rows[prefix]


def _chain(p: Tables, tokens: tuple[int, ...], start: tuple[int, ...] = ()) -> float:
    probability = 1.0
    for i in range(len(tokens)):
        probability *= float(p(start + tokens[:i])[tokens[i]])
    return probability


def _speculative_distribution(p: Tables, q: Tables | None, deterministic, k: int) -> dict[tuple[int, ...], float]:
    """P(first k + 1 tokens) when one speculative step runs first and the target continues after it."""
    vocab = p.vocab
    out: dict[tuple[int, ...], float] = {}

    def emit(prefix: tuple[int, ...], weight: float) -> None:  # the target finishes the k + 1 tokens
        remaining = k + 1 - len(prefix)
        for tail in itertools.product(range(vocab), repeat=remaining):
            total = prefix + tail
            out[total] = out.get(total, 0.0) + weight * _chain(p, tail, prefix)

    if q is None:
        draft_runs = [(deterministic(k), 1.0)]
    else:
        draft_runs = [(d, _chain(q, d)) for d in itertools.product(range(vocab), repeat=k)]
    for drafts, draft_weight in draft_runs:
        if draft_weight == 0.0:
            continue
        kept = 1.0  # probability that every draft so far was accepted
        for i, d in enumerate(drafts):
            prefix = tuple(drafts[:i])
            p_row, q_row = p(prefix), (q(prefix) if q is not None else None)
            a = accept_probability(p_row, q_row, d)
            if a < 1.0:  # rejected here: the residual's draw replaces d
                residual = residual_distribution(p_row, q_row, d)
                for token in range(vocab):
                    if residual[token] > 0:
                        emit(prefix + (token,), draft_weight * kept * (1.0 - a) * float(residual[token]))
            kept *= a
            if kept == 0.0:
                break
        else:
            bonus = p(tuple(drafts))
            for token in range(vocab):
                emit(tuple(drafts) + (token,), draft_weight * kept * float(bonus[token]))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("drafts", ["sampled", "deterministic", "deterministic_wrong"])
def test_every_accept_reject_path_sums_to_the_target_distribution(k, drafts):
    vocab = 5 if k == 4 else 7
    for trial in range(3):
        seed = 1000 * k + 10 * trial
        p = Tables(vocab, seed, peaked=trial == 1)
        q = Tables(vocab, seed + 1, peaked=trial == 2) if drafts == "sampled" else None
        if drafts == "deterministic":  # the target's most likely token, usually right
            def deterministic(k, p=p):
                run: tuple[int, ...] = ()
                for _ in range(k):
                    run += (int(p(run).argmax()),)
                return run
        else:  # the least likely token, possibly of probability 0: usually wrong
            def deterministic(k, p=p):
                run: tuple[int, ...] = ()
                for _ in range(k):
                    run += (int(p(run).argmin()),)
                return run
        got = _speculative_distribution(p, q, deterministic, k)
        total = 0.0
        for tokens in itertools.product(range(vocab), repeat=k + 1):
            want = _chain(p, tokens)
            assert got.get(tokens, 0.0) == pytest.approx(want, abs=1e-12), (tokens, trial)
            total += got.get(tokens, 0.0)
        assert total == pytest.approx(1.0, abs=1e-12)


def test_accept_probability_and_residual_on_known_values():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.0, 0.25], dtype=torch.float64)
    assert accept_probability(p, q, 0) == 1.0  # p >= q: always kept
    assert accept_probability(p, q, 1) == pytest.approx(0.6)
    assert accept_probability(p, q, 3) == 0.0  # the target never emits it
    assert accept_probability(p, None, 1) == pytest.approx(0.3)  # one-hot q: p(d)
    assert torch.allclose(residual_distribution(p, q, 1), torch.tensor([0.25, 0.0, 0.2, 0.0], dtype=torch.float64) / 0.45)
    assert torch.allclose(residual_distribution(p, None, 0), torch.tensor([0.0, 0.6, 0.4, 0.0], dtype=torch.float64))
    assert torch.equal(residual_distribution(p, p, 0), p)  # no residual mass: rejection cannot happen


def test_verify_draft_draws_match_the_target_frequencies():
    """The sampling code (two uniform draws) against p, for a draft of middling probability."""
    p = torch.tensor([0.1, 0.45, 0.05, 0.4], dtype=torch.float64)
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(4, dtype=torch.float64)
    kept = 0
    num = 40_000
    for _ in range(num):
        token, accepted = verify_draft(p, None, 3, generator)
        counts[token] += 1
        kept += accepted
    assert kept / num == pytest.approx(0.4, abs=0.01)
    chi2 = float(((counts - num * p) ** 2 / (num * p)).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), torch.tensor(chi2 / 2)))  # df 3
    assert p_value > 0.001, (counts / num, chi2)
