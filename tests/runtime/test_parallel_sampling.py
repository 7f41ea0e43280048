"""n > 1: samples share the prompt's pages; the partial last page is copied on first write."""

import random

from runtime import Engine, SamplingParams


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]


def test_greedy_samples_all_equal_the_single_greedy_output(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    prompt = _prompt(21)
    single = engine.generate([prompt], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))[0]
    multi = engine.generate([prompt], SamplingParams(n=3, max_tokens=25, temperature=0, ignore_eos=True))[0]
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    assert all(o.token_ids == single.outputs[0].token_ids for o in multi.outputs)
    assert engine.stats()["num_free_blocks"] == 64


def test_seeded_samples_differ_from_each_other_and_repeat_exactly(stories_dir):
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    first = [o.token_ids for o in engine.generate([_prompt(10)], params)[0].outputs]
    again = [o.token_ids for o in engine.generate([_prompt(10)], params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 4


def test_prompt_pages_are_shared_and_only_the_partial_one_is_copied(stories_dir):
    # 40-token prompt, 16-token pages: 2 full pages + 1 partial page (8 tokens)
    engine = Engine.from_pretrained(stories_dir, num_blocks=64, enable_prefix_caching=False)
    engine.add_request("r", _prompt(40), SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True))
    engine.step()  # prefill, fork into 4 samples
    assert engine.stats()["num_used_blocks"] == 3  # one copy of the prompt for four readers
    assert [b.ref_count for b in engine.kv.pool.blocks[:3]] == [4, 4, 4]
    engine.step()  # each sample writes position 40, inside the shared partial page
    stats = engine.stats()
    assert stats["num_used_blocks"] == 2 + 4  # full pages still shared; 3 copies + the original
    assert [b.ref_count for b in engine.kv.pool.blocks[:2]] == [4, 4]
    assert stats["num_kv_tokens"] == 32 + 4 * 9
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_free_blocks"] == 64


def test_forked_samples_survive_preemption(stories_dir):
    params = SamplingParams(n=3, max_tokens=60, temperature=0, ignore_eos=True)
    roomy = Engine.from_pretrained(stories_dir, num_blocks=64)
    expected = [o.token_ids for o in roomy.generate([_prompt(30, 1)], params)[0].outputs]
    tight = Engine.from_pretrained(stories_dir, num_blocks=9, max_num_batched_tokens=32)
    outputs = tight.generate([_prompt(30, 1)], params)[0].outputs
    assert [o.token_ids for o in outputs] == expected
    assert tight.stats()["num_preemptions"] > 0
