"""Batched, staggered, chunked and preempted runs give each prompt the tokens it gets alone."""

import random

import pytest

from runtime import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 70))] for _ in range(n)]


def _alone(model_dir, prompts) -> list[list[int]]:
    engine = Engine.from_pretrained(model_dir, num_blocks=128, enable_prefix_caching=False)
    return [engine.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def _staggered(engine: Engine, prompts, every: int = 3) -> dict[str, list[int]]:
    """Add one prompt every `every` steps; run until all finish; check invariants each step."""
    results, step, pending = {}, 0, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_invariants()
        step += 1
    return results


@pytest.fixture(scope="module")
def prompts():
    return _prompts(8, seed=3)


@pytest.fixture(scope="module")
def expected(stories_dir, prompts):
    return _alone(stories_dir, prompts)


def test_batched_together_equals_alone(stories_dir, prompts, expected):
    engine = Engine.from_pretrained(stories_dir, num_blocks=128)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_staggered_arrivals_with_chunked_prefill_equal_alone(stories_dir, prompts, expected):
    engine = Engine.from_pretrained(stories_dir, num_blocks=128, max_num_batched_tokens=24, max_num_seqs=5)
    results = _staggered(engine, prompts)
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.stats()["num_free_blocks"] == 128


def test_preemption_keeps_outputs_identical(stories_dir, prompts, expected):
    # 16 pages of 16 tokens cannot hold 8 sequences of up to ~110 tokens: preemption must happen
    engine = Engine.from_pretrained(stories_dir, num_blocks=16, max_num_batched_tokens=32)
    results = _staggered(engine, prompts, every=1)
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == 16 and stats["num_running"] == 0


def test_preemption_without_prefix_cache_keeps_outputs_identical(stories_dir, prompts, expected):
    engine = Engine.from_pretrained(stories_dir, num_blocks=16, max_num_batched_tokens=32, enable_prefix_caching=False)
    results = _staggered(engine, prompts, every=1)
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.stats()["num_preemptions"] > 0


def test_random_llama_batched_and_chunked_equals_alone(random_checkpoints):
    path = random_checkpoints["llama-gqa"]
    prompts = _prompts(5, seed=11)
    expected = _alone(path, prompts)
    engine = Engine.from_pretrained(path, num_blocks=24, block_size=8, max_num_batched_tokens=16)
    results = _staggered(engine, prompts, every=2)
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected
