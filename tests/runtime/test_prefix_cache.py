"""Prefix caching: shared full pages, salted chains, same tokens cold or warm."""

import random

from kernels import cascade
from runtime import Engine, SamplingParams
from tests.conftest import hf_greedy
from tests.runtime.helpers import make_seq

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]


def test_shared_three_block_prefix_is_cached(stories_dir):
    prefix = _tokens(48, seed=1)
    first = prefix + _tokens(9, seed=2)[1:]
    second = prefix + _tokens(13, seed=3)[1:]
    cold = Engine.from_pretrained(stories_dir, num_blocks=64).generate([second], GREEDY)[0]
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    assert engine.generate([first], GREEDY)[0].num_cached_tokens == 0
    warm = engine.generate([second], GREEDY)[0]
    assert warm.num_cached_tokens == 48
    assert cold.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 48
    assert stats["prefix_cache_queries"] == len(first) + len(second)


def test_different_salt_shares_nothing(stories_dir):
    prompt = _tokens(60, seed=4)
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 48


def test_whole_prompt_hit_still_computes_the_last_token(stories_dir):
    prompt = _tokens(64, seed=5)  # exactly 4 pages: the 4th is recomputed for its logits
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    first = engine.generate([prompt], GREEDY)[0]
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_decode_pages_are_cached_too(stories_dir):
    prompt = _tokens(10, seed=6)
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    first = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    follow_up = prompt + first.outputs[0].token_ids + [300, 301]
    assert engine.generate([follow_up], GREEDY)[0].num_cached_tokens == 48


def test_cache_off_reports_no_hits(stories_dir):
    prompt = _tokens(60, seed=7)
    engine = Engine.from_pretrained(stories_dir, num_blocks=64, enable_prefix_caching=False)
    engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert engine.stats()["num_cached_blocks"] == 0


def test_eviction_takes_the_oldest_tail_pages_first(stories_dir):
    old, recent = _tokens(40, seed=8), _tokens(40, seed=9)
    engine = Engine.from_pretrained(stories_dir, num_blocks=8)
    one = SamplingParams(max_tokens=1, temperature=0)
    engine.generate([old], one)  # pages 0 1 2, blocks 0-1 cached; freed tail first
    engine.generate([recent], one)  # pages 3 4 5, blocks 0-1 cached
    engine.generate([_tokens(60, seed=10)], one)  # 4 pages: two free, old's partial, then old's block 1

    def cached_pages(tokens):
        return len(engine.kv.find_cached_prefix(make_seq("probe", tokens)))

    assert cached_pages(old) == 1  # its head page survives its tail
    assert cached_pages(recent) == 2
    assert engine.kv.pool.num_evictions == 1


def test_prompts_sharing_a_prefix_compute_it_once_and_decode_reading_it_together(stories_dir, monkeypatch):
    prefix = _tokens(40, seed=11)  # five 8-token pages
    prompts = [prefix + _tokens(n, seed=20 + n)[1:] for n in (3, 6, 9, 12)]
    shared_rows = []
    real = cascade.cascade_decode_attention

    def spy(q, k_cache, v_cache, plan, scale):
        shared_rows.append(plan.num_shared_rows)
        return real(q, k_cache, v_cache, plan, scale)

    monkeypatch.setattr(cascade, "cascade_decode_attention", spy)
    engine = Engine.from_pretrained(stories_dir, num_blocks=64, block_size=8)
    outputs = engine.generate(prompts, GREEDY)
    # all four arrive in one step: the first computes the prefix, the others hit its pages
    assert [o.num_cached_tokens for o in outputs] == [0, 40, 40, 40]
    assert max(shared_rows) == 4  # every decode step read the five pages once for all four
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(stories_dir, prompts, 20)
