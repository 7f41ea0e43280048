"""Suffix decoding: past answers kept per cache scope, counted, bounded, and never crossing a salt."""

from __future__ import annotations

import pytest

from runtime import SamplingParams
from runtime.speculative.proposers import SuffixProposer
from runtime.speculative.suffix import SuffixCache, SuffixTrie
from tests.runtime.helpers import make_seq
from tests.runtime.speculative.engine_helpers import engine, run, tokens

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def test_the_most_frequent_continuation_of_the_longest_match_drafts():
    trie = SuffixTrie(max_depth=6)
    for record in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [7, 2, 3, 5]):
        trie.insert(record)
    # "2 3" was followed by 4 twice, 9 once, 5 once: 4 (p = 1/2); "1 2 3" narrows it to 4 of 3 (p = 2/3)
    assert trie.propose([8, 2, 3], 3, max_match=5, max_spec_factor=1.0, min_token_prob=0.1) == ([4], 2)
    assert trie.propose([1, 2, 3], 3, 5, 1.0, 0.1) == ([4], 3)  # only 4 ever follows: one token left here
    assert trie.propose([0, 1], 3, 5, 1.0, 0.1) == ([2], 1)  # match 1: at most 1 × 1.0 drafts
    assert trie.propose([0, 1], 3, 5, 3.0, 0.1) == ([2, 3, 4], 1)  # factor 3: three, p 1 · 1 · 2/3
    assert trie.propose([0, 1], 3, 5, 3.0, 0.7) == ([2, 3], 1)  # 2/3 < 0.7 stops before 4
    assert trie.propose([6], 3, 5, 1.0, 0.1) == ([], 0)  # never seen


def test_removing_a_record_takes_back_exactly_its_counts():
    trie = SuffixTrie(max_depth=4)
    trie.insert([1, 2, 3])
    nodes_one = trie.num_nodes
    trie.insert([1, 2, 5, 6, 7])
    assert trie.num_nodes > nodes_one
    assert trie.propose([1, 2], 1, 3, 1.0, 0.0)[0] in ([3], [5])
    trie.remove([1, 2, 5, 6, 7])
    assert trie.num_nodes == nodes_one and trie.root_count == 3
    assert trie.propose([1, 2], 1, 3, 1.0, 0.0) == ([3], 2)
    assert trie.propose([5, 6], 1, 3, 1.0, 0.0) == ([], 0)
    trie.remove([1, 2, 3])
    assert trie.num_nodes == 0 and trie.root_count == 0 and not trie._child


def test_the_cache_is_bounded_oldest_record_out_and_scopes_are_apart():
    cache = SuffixCache(max_depth=8, max_cached_requests=2)
    cache.add(b"a", [1, 2, 3, 4])
    cache.add(b"b", [1, 2, 9, 9])
    assert cache.trie(b"a").propose([1, 2], 2, 6, 1.0, 0.1) == ([3, 4], 2)
    assert cache.trie(b"b").propose([1, 2], 2, 6, 1.0, 0.1) == ([9, 9], 2)  # "b" never sees "a"'s answer
    assert cache.trie(None) is None
    nodes = cache.num_nodes
    for i in range(10):  # a stream of answers: the bound holds, the oldest go first
        cache.add(b"b", [20 + i, 21 + i, 22 + i, 23 + i])
        assert len(cache.records) == 2 and cache.num_nodes <= nodes + 20
    assert cache.trie(b"a") is None  # its only record was evicted: the scope is gone
    assert cache.trie(b"b").propose([1, 2], 2, 6, 1.0, 0.1) == ([], 0)
    assert cache.trie(b"b").propose([28, 29], 2, 6, 1.0, 0.1) == ([30, 31], 2)
    SuffixCache(8, 0).add(b"a", [1, 2])  # a bound of 0 keeps nothing


def _finish(seq, outputs):
    seq.token_ids += outputs
    seq.finish_reason = "length"


def test_the_proposer_drafts_only_from_answers_in_the_same_salt():
    proposer = SuffixProposer(2, 3, max_depth=12, max_cached_requests=100, max_spec_factor=2.0,
                              min_token_prob=0.1, max_drafts=4)
    question = [50, 51, 52, 53]
    first = make_seq("a1", question, salt=b"tenant-a")
    _finish(first, [60, 61, 62, 63, 64, 65])
    proposer.forget(first)
    again = make_seq("a2", question, salt=b"tenant-a")
    assert proposer.propose(again, 4) == [60, 61, 62, 63]  # the question asked again: its answer from the start
    other = make_seq("b1", question, salt=b"tenant-b")
    assert proposer.propose(other, 4) == []  # the same question from another tenant: nothing
    unsalted = make_seq("n1", question)
    assert proposer.propose(unsalted, 4) == []
    # the sequence's own text still drafts (prompt lookup), and a longer own match beats a shorter past one
    own = make_seq("a3", [72, 60, 61, 70, 71, 72, 60, 61], salt=b"tenant-a")  # own "72 60 61" vs past "60 61"
    assert proposer.propose(own, 2) == [70, 71]


def test_aborted_and_pinned_answers_are_not_kept():
    proposer = SuffixProposer(1, 2, 12, 100, 1.0, 0.1, 4)
    aborted = make_seq("x", [1, 2], salt=b"s")
    aborted.token_ids += [3, 4]
    aborted.finish_reason = "abort"
    proposer.forget(aborted)
    assert proposer.cache.trie(b"s") is None


@pytest.fixture(scope="module")
def questions(stories_dir):
    plain = engine(stories_dir)
    prompts = [plain.tokenizer.encode(text) for text in
               ("Once upon a time, there was a little", "The dog wanted to play with", "One day, Lily found a")]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return prompts, params, tokens(run(plain, prompts, params))


def test_a_repeated_question_drafts_from_its_past_answer_and_changes_no_token(stories_dir, questions):
    prompts, params, want = questions
    spec = engine(stories_dir, SUFFIX)
    assert tokens(run(spec, prompts, params, cache_salt="tenant-a")) == want
    first = spec.speculator.stats.num_accepted_tokens
    assert tokens(run(spec, prompts, params, cache_salt="tenant-a")) == want  # asked again: drafts from the past
    stats = spec.speculator.stats
    again = stats.num_accepted_tokens - first
    assert again >= 0.8 * len(prompts) * params.max_tokens * 4 / 5  # nearly every token came from a kept draft
    # another tenant asking the same questions finds nothing of tenant-a's
    asked = []
    cache = spec.speculator.proposer.cache
    original = cache.trie
    cache.trie = lambda scope: asked.append(scope) or original(scope)
    before = stats.num_accepted_tokens
    assert tokens(run(spec, prompts, params, cache_salt="tenant-b")) == want
    assert asked and set(asked) == {b"tenant-b"}
    assert stats.num_accepted_tokens - before < again / 2
