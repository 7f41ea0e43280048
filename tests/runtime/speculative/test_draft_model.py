"""method "draft_model": a second checkpoint drafts over its own pages, and the answer does not change.

Drafts come from stories260K cut to its first two layers (plus embeddings, final norm and
head: the same tokenizer, often right, often wrong), or from stories260K itself (an oracle).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from config import ConfigError
from runtime import SamplingParams
from runtime.speculative.draft_model import DraftModelProposer
from tests.conftest import hf_greedy
from tests.runtime.speculative.engine_helpers import engine, first_layers_checkpoint, run, tokens
from tests.runtime.speculative.test_sampling_exactness import (FIELDS, JOINT, STORY, _chi_square_p, _forcing,
                                                               _recording)

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = ["Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom", "Once upon a time",
           "The cat sat on the mat. The cat"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, stories_dir):
    return first_layers_checkpoint(stories_dir, tmp_path_factory.mktemp("draft") / "stories-2l", 2)


@pytest.fixture(scope="module")
def reference(stories_dir):
    plain = engine(stories_dir)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    return prompts, tokens(run(plain, prompts, GREEDY))


def _draft(model, k: int = 4, **keys) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **keys}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_draft_model_changes_no_greedy_token(stories_dir, draft_dir, reference, k):
    prompts, want = reference
    spec = engine(stories_dir, _draft(draft_dir, k))
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # a real draft: kept and refused
    assert not any(stats.accepted_per_position[k:])
    assert spec.stats()["draft_num_used_blocks"] == 0  # every draft page went back


def test_the_target_as_its_own_draft_keeps_every_draft(stories_dir, reference):
    prompts, want = reference
    spec = engine(stories_dir, _draft(stories_dir, 4))
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_an_always_wrong_draft_keeps_none(stories_dir, draft_dir, reference, monkeypatch):
    prompts, want = reference
    spec = engine(stories_dir, _draft(draft_dir, 3))
    vocab = spec.limits.vocab_size
    original = DraftModelProposer._draw

    script = {tuple(p): w[0] for p, w in zip(prompts, want)}

    def wrong(self, batch, jobs, drafts, probs):  # the draft model runs; its draft is replaced by a sure miss
        original(self, batch, jobs, drafts, probs)
        for seq, state, _ in jobs:  # this draft's position is the next one after the draft's KV
            target = script[tuple(seq.token_ids[: seq.num_prompt_tokens])][len(state.token_ids) - seq.num_prompt_tokens]
            drafts[seq.seq_id][-1] = (target + 1) % vocab

    monkeypatch.setattr(DraftModelProposer, "_draw", wrong)
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0


def test_each_steps_drafts_are_the_draft_checkpoints_own_greedy_continuation(stories_dir, draft_dir, reference,
                                                                             monkeypatch):
    """The draft's KV after rollbacks and catch-ups is right: every step's drafts equal what transformers'
    greedy decoding of the draft checkpoint gives from the sequence's tokens at that step."""
    prompts, _ = reference
    spec = engine(stories_dir, _draft(draft_dir, 4))
    seen: list[tuple[list[int], list[int]]] = []
    original = DraftModelProposer.propose_batch

    def recording(self, seqs, counts):
        made = original(self, seqs, counts)
        seen.extend((list(seq.token_ids), drafts) for seq, (drafts, _) in zip(seqs, made))
        return made

    monkeypatch.setattr(DraftModelProposer, "propose_batch", recording)
    run(spec, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(seen) > 10
    for context, drafts in seen[::3]:
        assert hf_greedy(draft_dir, [context], len(drafts))[0] == drafts, len(context)


def test_draft_pages_come_from_their_own_stated_budget(stories_dir, draft_dir, reference):
    """Three draft pages: the sequences that do not fit draft nothing that step; the target's pool is untouched."""
    prompts, want = reference
    plain = engine(stories_dir)
    spec = engine(stories_dir, _draft(draft_dir, 4, draft_num_blocks=3))
    assert spec.num_blocks == plain.num_blocks  # the draft's pages are not taken from the target's
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.stats()
    assert stats["draft_num_blocks"] == 3 and stats["draft_num_used_blocks"] == 0
    assert stats["draft_num_skipped_for_pages"] > 0 and spec.speculator.stats.num_accepted_tokens > 0


def test_an_aborted_request_returns_its_draft_pages(stories_dir, draft_dir):
    spec = engine(stories_dir, _draft(draft_dir, 4))
    spec.add_request("a", STORY, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    spec.add_request("b", "Once upon a time", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(6):
        spec.step()
    draft = spec.speculator.proposer
    assert draft.num_used_blocks > 0
    spec.abort_request("a")
    spec.step()
    spec.check_invariants()
    assert "a" not in draft.states and "b" in draft.states
    spec.abort_request("b")
    spec.step()
    assert draft.num_used_blocks == 0 and not draft.states


def test_a_draft_with_another_vocabulary_is_refused(stories_dir, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64)
    path = tmp_path / "other-vocabulary"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    with pytest.raises(ConfigError, match="vocabulary"):
        engine(stories_dir, _draft(path))


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "grammar"])
def test_sampled_drafts_verify_against_what_the_plain_sampler_would_draw(stories_dir, draft_dir, monkeypatch, field):
    """q is not one-hot here (the draft samples): p at every emitted position still equals the plain sampler's."""
    params = SamplingParams(max_tokens=30, seed=11, **FIELDS[field])
    spec = engine(stories_dir, _draft(draft_dir, 4))
    prompt = spec.tokenizer.encode(STORY)
    calls = _recording(monkeypatch)
    got = run(spec, [prompt], params)[0].outputs[0]
    spec_probs = list(calls)
    stats = spec.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert len(spec_probs) == len(got.token_ids)  # one distribution per emitted token
    plain = engine(stories_dir)
    forced = got.token_ids
    _forcing(monkeypatch, forced)
    calls.clear()
    assert run(plain, [prompt], params)[0].outputs[0].token_ids == forced
    assert len(calls) == len(forced)
    for position, (a, b) in enumerate(zip(spec_probs, calls)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"position {position}")


@pytest.mark.parametrize("case", ["plain", "grammar"])
def test_sampled_outputs_are_distributed_as_without_speculation(stories_dir, draft_dir, case):
    """Target and draft differ, the draft samples from its own q: a chi-square test of the joint outputs. Under a
    grammar the draft often proposes what the grammar refuses, which verification must reject by the rule."""
    fields, text = JOINT[case]
    num = 800
    outputs = {}
    for speculative in (False, True):
        e = engine(stories_dir, _draft(draft_dir, 3) if speculative else None, max_num_seqs=256)
        prompt = e.tokenizer.encode(text)
        params = [SamplingParams(seed=1_000 * speculative + i, ignore_eos=True, **fields) for i in range(num)]
        outputs[speculative] = Counter(tuple(o.outputs[0].token_ids) for o in run(e, [prompt] * num, params))
        if speculative:
            stats = e.speculator.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    p_value = _chi_square_p(outputs[False], outputs[True])
    assert p_value > 0.001, (p_value, outputs[False].most_common(8), outputs[True].most_common(8))


def test_a_seed_reproduces_the_same_output_with_a_sampling_draft(stories_dir, draft_dir):
    params = SamplingParams(max_tokens=30, seed=5, temperature=1.0)
    runs = []
    for _ in range(2):
        spec = engine(stories_dir, _draft(draft_dir, 4))
        runs.append(run(spec, [spec.tokenizer.encode(STORY)], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


class _HalfRefusedDraft:
    """A sampled draft for the second output token (the first is the prefill's): q puts half its mass on
    `token`, half on a token the grammar refuses. Verification must reject the refused one by the rule,
    drawing from max(p - q, 0); cutting it instead (and drawing from p) would give `token` up to 1.5 times
    its probability."""

    sources, source, batched = ("half_refused",), "half_refused", True

    def __init__(self, token: int, vocab_size: int) -> None:
        self.token = token
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(5)

    def draft_cost(self, target_fixed_seconds: float) -> float:
        return 0.0

    def propose_batch(self, seqs, counts):
        made = []
        for seq in seqs:
            if seq.num_output_tokens != 1:
                made.append(([], None))
                continue
            refused = next(t for t in range(self.vocab_size) if seq.grammar.num_valid([t]) == 0)
            q = torch.zeros(self.vocab_size)
            q[self.token] = q[refused] = 0.5
            made.append(([self.token if float(torch.rand((), generator=self.generator)) < 0.5 else refused], q[None]))
        return made

    def forget(self, seq) -> None:
        pass


def test_a_sampled_draft_the_grammar_refuses_is_rejected_by_the_rule(stories_dir):
    fields, text = JOINT["grammar"]
    num = 600
    pairs = {}  # the first two output tokens
    for speculative in (False, True):
        e = engine(stories_dir, max_num_seqs=256)
        prompt = e.tokenizer.encode(text)
        if speculative:  # half-refused drafts around the plain run's likeliest second token
            token = Counter(second for _, second in pairs[False].elements()).most_common(1)[0][0]
            e.speculator.proposer = _HalfRefusedDraft(token, e.limits.vocab_size)
        params = [SamplingParams(seed=1_000 * speculative + i, ignore_eos=True, **{**fields, "max_tokens": 3})
                  for i in range(num)]
        pairs[speculative] = Counter(tuple(o.outputs[0].token_ids[:2]) for o in run(e, [prompt] * num, params))
    p_value = _chi_square_p(pairs[False], pairs[True])
    assert p_value > 0.001, (p_value, pairs[False].most_common(4), pairs[True].most_common(4))
    stats = e.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # refused drafts were verified and rejected
