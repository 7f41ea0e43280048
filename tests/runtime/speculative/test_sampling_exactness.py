"""Sampling with speculation draws from the target's distribution, exactly.

- Replay: the distribution at every position a speculative run emitted (verified drafts,
  rejections, bonus tokens) equals what the engine without speculation computes for the same
  tokens, fed one at a time, for every sampling field.
- Joint distribution: seeded runs with and without speculation, a chi-square test of
  homogeneity on their outputs (plain, penalised, grammar-constrained).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from runtime import SamplingParams
from runtime.sampler import Sampler
from runtime.speculative import speculator
from runtime.structured_outputs import StructuredOutputs
from tests.runtime.speculative.engine_helpers import (NGRAM, GrammarWalkProposer, GreedyModelProposer, RandomProposer,
                                                      engine, run)

STORY = "Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom"
FIELDS = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "presence_penalty": dict(temperature=0.7, presence_penalty=1.5),
    "frequency_penalty": dict(temperature=0.7, frequency_penalty=1.2),
    "repetition_penalty": dict(temperature=0.7, repetition_penalty=1.4),
    "logit_bias": dict(temperature=0.7, logit_bias={400: 4.0, 280: -3.0}),
    "logprobs": dict(temperature=0.8, logprobs=3),
    "min_tokens": dict(temperature=1.0, min_tokens=30),  # EOS held back (p = 0) for the first 30 positions
    # no byte forced between words (every word may be followed by " " or "."): where llguidance 1.9 forces one
    # (" " after "Lily" in "(Lily|Tom) (ran|saw)", or after " and" in "( and (Lily|Tom))"), its mask
    # on this sentencepiece vocabulary allows tokens its consume then refuses (docs/api.md: the known llguidance issue)
    "grammar": dict(temperature=1.0, structured_outputs=StructuredOutputs(
        regex=r"(Lily|Tom)( and| Lily| Tom| ran| saw| a| the| big| tree| park)*\.")),
}


def _recording(monkeypatch) -> list[torch.Tensor]:
    """Every distribution the target's sampler draws a token from, row by row (plain rows and verified positions
    alike come through Sampler.target_probs_rows)."""
    calls: list[torch.Tensor] = []
    original = Sampler.target_probs_rows

    def target_probs_rows(rows, meta):
        probs = original(rows, meta)
        calls.extend(row.clone() for row in probs)
        return probs

    monkeypatch.setattr(Sampler, "target_probs_rows", staticmethod(target_probs_rows))
    return calls


def _forcing(monkeypatch, forced: list[int]) -> None:
    """The plain sampler computes (and records) each row's distribution, then emits `forced` (by output position),
    with the logprobs of the forced token."""
    original_call = Sampler.__call__

    def forced_call(self, logits, seqs):
        original_call(self, logits, seqs)
        token_ids = [forced[seq.num_output_tokens] for seq in seqs]
        raw = torch.log_softmax(logits.float().cpu(), dim=-1)
        return token_ids, [Sampler._logprobs(raw[i], token_id, seq.params.logprobs)
                           if seq.params.logprobs is not None else None
                           for i, (token_id, seq) in enumerate(zip(token_ids, seqs))]

    monkeypatch.setattr(Sampler, "__call__", forced_call)


@pytest.mark.parametrize("field", list(FIELDS))
def test_every_verified_position_draws_from_what_the_plain_sampler_would(stories_dir, monkeypatch, field):
    params = SamplingParams(max_tokens=40, seed=11, **FIELDS[field])
    spec = engine(stories_dir, {**NGRAM, "num_speculative_tokens": 4})
    prompt = spec.tokenizer.encode(STORY)
    # the model's own greedy guess: often kept, not always; under a grammar (which cuts what it refuses),
    # tokens the grammar allows
    spec.speculator.proposer = GrammarWalkProposer(spec.limits.vocab_size) if params.structured_outputs is not None \
        else GreedyModelProposer(stories_dir)
    calls = _recording(monkeypatch)
    got = run(spec, [prompt], params)[0].outputs[0]
    spec_probs = list(calls)
    stats = spec.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # kept and rejected drafts both happened
    assert len(spec_probs) == len(got.token_ids)  # one distribution per emitted token

    plain = engine(stories_dir)  # fed the speculative run's tokens, one at a time
    forced = got.token_ids
    _forcing(monkeypatch, forced)
    calls.clear()
    replay = run(plain, [prompt], params)[0].outputs[0]
    assert replay.token_ids == forced
    assert len(calls) == len(spec_probs)
    for position, (a, b) in enumerate(zip(spec_probs, calls)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"position {position}")
    if params.logprobs is not None:  # logprobs come from the target
        for a, b in zip(got.logprobs, replay.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (cells with < 5 expected merged); its p-value."""
    na, nb = sum(a.values()), sum(b.values())
    cells, other = [], (0, 0)
    for key in set(a) | set(b):
        expected = (a[key] + b[key]) * min(na, nb) / (na + nb)
        if expected < 5:
            other = (other[0] + a[key], other[1] + b[key])
        else:
            cells.append((a[key], b[key]))
    if sum(other):
        cells.append(other)
    chi2 = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            chi2 += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)))


JOINT = {
    "plain": (dict(temperature=1.0, max_tokens=3), "Once upon a time, there was a"),
    "penalised": (dict(temperature=1.0, max_tokens=3, repetition_penalty=1.5, presence_penalty=0.5), "Tom and Tom and"),
    "grammar": (dict(temperature=1.5, max_tokens=8, structured_outputs=StructuredOutputs(
        choice=["red ball", "blue ball", "red car", "big dog"])), "Lily saw a"),
}


@pytest.mark.parametrize("case", list(JOINT))
def test_outputs_are_distributed_as_without_speculation(stories_dir, monkeypatch, case):
    fields, text = JOINT[case]
    # every sequence drafts as much as it may (the policy would cut drafts in a batch this large)
    monkeypatch.setattr(speculator, "plan_drafts", lambda gains, *rest: [len(g) for g in gains])
    num = 1200
    outputs = {}
    for speculative in (False, True):
        e = engine(stories_dir, max_num_seqs=256)
        prompt = e.tokenizer.encode(text)
        if speculative:  # drafts from the likely tokens (the plain run's), often right, often wrong
            e.speculator.proposer = RandomProposer(sorted({t for key in outputs[False] for t in key}), seed=3)
        params = [SamplingParams(seed=1_000 * speculative + i, ignore_eos=True, **fields) for i in range(num)]
        got = run(e, [prompt] * num, params)
        outputs[speculative] = Counter(tuple(o.outputs[0].token_ids) for o in got)
        if speculative:
            stats = e.speculator.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    p_value = _chi_square_p(outputs[False], outputs[True])
    assert p_value > 0.001, (p_value, outputs[False].most_common(8), outputs[True].most_common(8))


def test_a_seed_reproduces_the_same_output_with_the_same_speculative_settings(stories_dir):
    params = SamplingParams(max_tokens=40, seed=5, temperature=1.0)
    runs = []
    for _ in range(2):
        spec = engine(stories_dir, NGRAM)
        runs.append(run(spec, [spec.tokenizer.encode(STORY)], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(stories_dir):
    spec = engine(stories_dir, {**NGRAM, "num_speculative_tokens": 8})
    params = SamplingParams(max_tokens=30, temperature=0, **{k: v for k, v in FIELDS["grammar"].items()
                                                             if k == "structured_outputs"})
    spec.add_request("g", spec.tokenizer.encode(STORY), params)
    seq = spec.requests["g"].sequences[0]
    while seq.num_output_tokens == 0:
        spec.step()
    vocab = range(spec.limits.vocab_size)
    walk = seq.grammar.copy()
    valid = []
    for _ in range(3):  # three tokens the grammar takes, in turn
        valid.append(next(t for t in vocab if walk.num_valid([t]) == 1))
        walk.accept(valid[-1])
    refused = next(t for t in vocab if walk.num_valid([t]) == 0)
    drafts = [*valid, refused, *valid]

    class Fixed:
        sources, source = ("fixed",), "fixed"

        def propose(self, seq, k):
            return drafts[:k]

        def forget(self, seq):
            pass

    spec.speculator.proposer = Fixed()
    proposed = spec.speculator.propose(spec.scheduler.running, lambda: 0, spec.max_model_len)
    assert proposed[seq.seq_id].token_ids == valid  # cut before the refused draft: it could never be kept
