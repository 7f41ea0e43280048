"""Greedy decoding with speculation gives the same tokens as without it, whatever drafts.

Each test runs the same prompts through an engine without speculation and one with it, and
checks the page invariants after every step (a hashed page holds only committed tokens; every
page comes back).
"""

from __future__ import annotations

import pytest

from runtime import SamplingParams
from tests.conftest import RANDOM_MODEL_NAMES
from tests.runtime.speculative.engine_helpers import NGRAM, ScriptProposer, engine, run, tokens

STORY = "Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom"
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def _prompts(e) -> list[list[int]]:
    return [e.tokenizer.encode(STORY), e.tokenizer.encode("Once upon a time"), e.tokenizer.encode("The cat sat. The cat")]


@pytest.fixture(scope="module")
def plain(stories_dir):
    return engine(stories_dir)


@pytest.fixture(scope="module")
def reference(plain):
    prompts = _prompts(plain)
    return prompts, tokens(run(plain, prompts, GREEDY))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_ngram_drafts_change_no_token(stories_dir, reference, k):
    prompts, want = reference
    spec = engine(stories_dir, {**NGRAM, "num_speculative_tokens": k})
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens and not any(stats.accepted_per_position[k:])


@pytest.mark.parametrize("wrong", [False, True], ids=["oracle", "always-wrong"])
def test_an_oracle_accepts_every_draft_and_a_wrong_draft_none(stories_dir, reference, wrong):
    prompts, want = reference
    script = {tuple(p): w[0] for p, w in zip(prompts, want)}
    spec = engine(stories_dir, proposer=ScriptProposer(script, wrong=wrong, vocab=512))
    assert tokens(run(spec, prompts, GREEDY)) == want
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == (0 if wrong else stats.num_draft_tokens)
    if not wrong:  # k accepted every time: each step emits k + 1 tokens
        assert stats.num_drafts <= -(-len(prompts) * GREEDY.max_tokens // 5) + len(prompts)


@pytest.mark.parametrize("name", RANDOM_MODEL_NAMES)
def test_random_models_give_the_same_tokens(random_checkpoints, name):
    path = random_checkpoints[name]
    plain = engine(path)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [1, 300, 7, 42, 300, 7], list(range(1, 40))]
    want = tokens(run(plain, prompts, GREEDY))
    script = {tuple(p): w[0] for p, w in zip(prompts, want)}
    for spec in (engine(path, NGRAM), engine(path, proposer=ScriptProposer(script))):
        assert tokens(run(spec, prompts, GREEDY)) == want
        assert spec.speculator.stats.num_accepted_tokens > 0


def test_mixed_batches_chunked_prefill_prefix_hits_and_preemption(stories_dir, reference):
    """Some requests draft (a prediction), some do not; long prompts are chunked; pages run short."""
    prompts, want = reference
    settings = dict(max_num_batched_tokens=24, num_blocks=40, block_size=4, enable_prefix_caching=True)
    plain, spec = engine(stories_dir, **settings), engine(stories_dir, **settings)
    shared = prompts[0] * 2
    batch = [shared + [29], shared + [31], prompts[1], prompts[2]]
    want = tokens(run(plain, batch, GREEDY))
    for repeat in range(2):  # the second time, the shared prefix is a cache hit
        for i, prompt in enumerate(batch):
            spec.add_request(f"r{repeat}-{i}", prompt, GREEDY,
                             prediction=want[i][0][: 30] if i % 2 == 0 else None)
        finals = {}
        while len(finals) < len(batch):
            for output in spec.step():
                if output.finished:
                    finals[output.request_id] = output
            spec.check_invariants()
        assert [[finals[f"r{repeat}-{i}"].outputs[0].token_ids] for i in range(len(batch))] == want
    assert spec.scheduler.num_preemptions > 0 and spec.scheduler.prefix_cache_hits > 0
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert spec.kv.pool.num_free_blocks == spec.num_blocks


def test_n_siblings_copy_their_shared_last_page_before_writing_drafts(stories_dir, plain):
    prompt = plain.tokenizer.encode(STORY)  # 20+ tokens: the forks share a partial last page
    params = SamplingParams(n=3, max_tokens=30, temperature=0, ignore_eos=True)
    want = tokens(run(plain, [prompt], params))
    spec = engine(stories_dir, NGRAM, block_size=8)
    assert tokens(run(spec, [prompt], params)) == want
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_a_stop_or_max_tokens_inside_an_accepted_run_ends_the_output_there(stories_dir, plain, reference):
    prompts, want = reference
    script = {tuple(p): w[0] for p, w in zip(prompts, want)}
    spec = engine(stories_dir, {**NGRAM, "num_speculative_tokens": 8}, proposer=ScriptProposer(script))
    for max_tokens in (1, 2, 5, 11):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        got = run(spec, prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [w[0][:max_tokens] for w in want]
        assert all(o.outputs[0].finish_reason == "length" for o in got)
    text = plain.tokenizer.decode(want[0][0])
    stop = text[len(text) // 3 : len(text) // 3 + 6]  # a string in the middle of the answer
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop=[stop])
    expected, got = run(plain, prompts[:1], params)[0].outputs[0], run(spec, prompts[:1], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (expected.text, expected.token_ids, "stop", stop)


def test_kv_at_committed_positions_equals_a_run_without_speculation(stories_dir, plain, reference):
    import torch

    prompts, want = reference
    script = {tuple(p): w[0] for p, w in zip(prompts, want)}
    spec = engine(stories_dir, proposer=ScriptProposer(script))
    caches = []
    for e in (plain, spec):
        e.add_request("kv", prompts[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        seq = e.requests["kv"].sequences[0]
        while seq.num_output_tokens < 25:
            e.step()
        bs = e.block_size
        table = e.kv.block_ids(seq)
        positions = range(seq.num_computed_tokens)
        caches.append(torch.stack([e.runner.kv_cache[:, :, table[p // bs], p % bs] for p in positions]))
        e.abort_request("kv")
        e.step()
    n = min(c.shape[0] for c in caches)
    assert n > len(prompts[0]) + 20
    torch.testing.assert_close(caches[1][:n], caches[0][:n], atol=1e-5, rtol=1e-5)


def test_speculation_off_takes_no_drafts(plain):
    """No method and no prediction: nothing is drafted (the plain path of every other test)."""
    assert plain.speculator.proposer is None
    run(plain, _prompts(plain)[:1], SamplingParams(max_tokens=8, temperature=0))
    assert plain.speculator.stats.num_draft_tokens == 0


def test_the_page_map_shows_each_running_sequences_drafts(stories_dir, plain, reference):
    prompts, want = reference
    spec = engine(stories_dir, NGRAM)
    spec.add_request("m", prompts[0], SamplingParams(max_tokens=30, temperature=0), prediction=want[0][0][:20])
    seq = spec.requests["m"].sequences[0]
    while seq.num_output_tokens < 8:
        spec.step()
    [entry] = spec.page_map()["sequences"]
    assert entry["num_draft_tokens"] > 0 and 0 < entry["num_accepted_draft_tokens"] <= entry["num_draft_tokens"]
    spec.abort_request("m")
    spec.step()


REWRITE = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
           "Why is the sky blue?", "How do I make a cup of tea?")


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_smollm2_q4_gives_the_same_tokens_with_ngram_drafts(smollm2_gguf, dtype):
    """A real chat model (its Q4_1 GGUF, 4-bit weights kept; auto: bfloat16 where the CPU has it). The
    open questions reach near-ties (two tokens within 0.01 nats) that a verification computed
    differently from a decode would flip: each verified row attends as its own decode."""
    plain = engine(smollm2_gguf, dtype=dtype, num_blocks=200)
    prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in REWRITE]
    params = SamplingParams(max_tokens=72, temperature=0)
    want = tokens(run(plain, prompts, params))
    spec = engine(smollm2_gguf, {**NGRAM, "num_speculative_tokens": 6}, dtype=dtype, num_blocks=200)
    assert tokens(run(spec, prompts, params)) == want
    assert spec.speculator.stats.num_accepted_tokens >= 10
