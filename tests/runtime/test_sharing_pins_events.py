"""Operator-shared prefixes across salts, pinned prefixes that survive eviction, KV events."""

import random

import pytest

from runtime import Engine, InvalidRequestError, SamplingParams
from runtime.kv_events import BlockStored, net_hashes

ONE = SamplingParams(max_tokens=1, temperature=0)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]


def test_shared_prefix_is_one_chain_across_salts_and_private_after(stories_dir):
    shared = _tokens(32, seed=1)  # two full pages marked shared
    prompt = shared + _tokens(40, seed=2)[1:]  # + 39 private tokens
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    engine.generate([prompt], ONE, cache_salt="tenant-a")  # plain: nothing shared
    outs = {}
    for request_id, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("b2", "tenant-b")):
        engine.add_request(request_id, prompt, ONE, cache_salt=salt, shared_prefix_len=32)
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
    assert outs["a"].num_cached_tokens == 0  # the shared chain differs from the plain salted one
    assert outs["b"].num_cached_tokens == 32  # b reads a's shared pages, not a's private ones
    assert outs["b2"].num_cached_tokens == 64  # its own private pages from before


def test_pinned_prefix_survives_pressure_and_unpin_releases_it(stories_dir):
    system = _tokens(48, seed=3)
    engine = Engine.from_pretrained(stories_dir, num_blocks=12, pinned_block_budget=4)
    engine.pin_prefix("sys", system, cache_salt="t")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_pinned_blocks"] == 3
    for seed in range(4, 10):  # fill and churn the rest of the pool
        engine.generate([_tokens(100, seed)], ONE, cache_salt="t")
    assert engine.kv.pool.num_evictions > 0
    out = engine.generate([system + [300, 301, 302]], ONE, cache_salt="t")[0]
    assert out.num_cached_tokens == 48
    assert engine.unpin_prefix("sys") and engine.stats()["num_pinned_blocks"] == 0
    engine.check_invariants()
    assert engine.stats()["num_free_blocks"] == 12


def test_pin_over_budget_is_refused(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=32, pinned_block_budget=2)
    with pytest.raises(InvalidRequestError) as info:
        engine.pin_prefix("big", _tokens(64, seed=1))
    assert info.value.code == "pin_budget_exceeded"


def test_kv_events_report_stored_and_removed_hashes(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=6, pinned_block_budget=0)
    engine.record_kv_events()
    first = _tokens(40, seed=11)
    engine.generate([first], ONE)
    stored, removed = net_hashes(engine.take_kv_events())
    assert len(stored) == 2 and removed == []
    assert set(stored) == set(engine.kv.pool.hash_to_block)
    engine.generate([_tokens(90, seed=12)], ONE)  # needs every page: evicts the first prompt's
    stored_2, removed_2 = net_hashes(engine.take_kv_events())
    assert set(removed_2) == set(stored) and len(stored_2) == 5
    assert engine.take_kv_events() == []


def test_stored_events_carry_tokens_parent_and_the_chain_salt(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=32)
    engine.record_kv_events()
    shared = _tokens(32, seed=5)  # two pages marked shared
    prompt = shared + _tokens(40, seed=6)[1:]  # 71 tokens: four full pages
    engine.add_request("r", prompt, ONE, cache_salt="tenant-a", shared_prefix_len=32)
    while engine.has_unfinished_requests():
        engine.step()
    events = engine.take_kv_events()
    assert [type(e) for e in events] == [BlockStored] * 4
    assert [e.token_ids for e in events] == [tuple(prompt[i * 16 : (i + 1) * 16]) for i in range(4)]
    assert [e.salt for e in events] == [None, None, b"tenant-a", b"tenant-a"]
    assert [e.salt_enters for e in events] == [False, False, True, False]
    assert events[0].parent_hash is None
    assert [e.parent_hash for e in events[1:]] == [e.block_hash for e in events[:-1]]
    block_hashes = engine.kv.pool.hash_to_block
    assert all(e.block_hash in block_hashes for e in events)


def test_unpin_before_the_prefill_ends_leaves_nothing_pinned(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=32, pinned_block_budget=8)
    engine.pin_prefix("early", _tokens(48, seed=4))
    assert engine.unpin_prefix("early")  # still queued: its prefill is aborted
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_pinned_blocks"] == 0 and engine.stats()["num_free_blocks"] == 32


def test_pinned_pages_never_make_a_request_unschedulable(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=8, pinned_block_budget=64)
    assert engine.pinned_block_budget == 2  # at most a quarter of the pool
    engine.pin_prefix("p", _tokens(32, seed=5))
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request("too-big", _tokens(90, seed=6), SamplingParams(max_tokens=10))
    outs = engine.generate([_tokens(80, seed=7), _tokens(20, seed=8)], SamplingParams(max_tokens=15, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [15, 15]
