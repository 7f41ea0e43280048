"""Greedy output equals Hugging Face transformers token for token (float32, sdpa)."""

import random

import pytest

from runtime import Engine, SamplingParams
from tests.conftest import RANDOM_MODEL_NAMES, hf_greedy

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def test_stories260k_matches_golden_file(stories_dir, golden):
    engine = Engine.from_pretrained(stories_dir, num_blocks=64)
    prompts = [case["prompt"] for case in golden["cases"]]
    outputs = engine.generate(prompts, GREEDY)
    for case, output in zip(golden["cases"], outputs):
        assert output.prompt_token_ids == case["prompt_ids"]
        assert output.outputs[0].token_ids == case["greedy_30_new_ids"]
        assert case["prompt"] + output.outputs[0].text == case["text"]


def test_stories260k_matches_transformers_on_longer_prompts(stories_dir):
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 47, 64)]
    engine = Engine.from_pretrained(stories_dir, num_blocks=128)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert ours == hf_greedy(stories_dir, prompts, 30)


@pytest.mark.parametrize("name", RANDOM_MODEL_NAMES)
def test_random_checkpoint_matches_transformers(random_checkpoints, name):
    path = random_checkpoints[name]
    rng = random.Random(name)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (4, 20, 41)]
    engine = Engine.from_pretrained(path, num_blocks=64, block_size=8)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert ours == hf_greedy(path, prompts, 30)
