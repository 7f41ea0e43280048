"""Each further family (Qwen3, Gemma 2, Gemma 3, Phi-3) equals transformers token for token (float32):
batched, through chunked prefill, prefix-cache hits and speculative decoding.

The checkpoints (tests/conftest.py `_family_configs`) switch on what each family adds and make
it matter: q/k norms, (1 + w) sandwich norms, GeGLU, scaled embeddings, small soft-caps, a
window of 24 (the longer prompts cross it), Gemma 3's local and global rope bases (the global
one scaled), LongRoPE factors and partial rotary.
"""

import random

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.model.config import load_model_config
from runtime.model.rope import rope_cos_sin
from tests.conftest import FAMILY_MODEL_NAMES, hf_greedy
from tests.runtime.speculative.engine_helpers import ScriptProposer, engine, run, tokens

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
ATTENTION = {"gemma2": "eager"}  # transformers' sdpa refuses soft-capped attention


def _prompts(name: str) -> list[list[int]]:
    rng = random.Random(name)
    randoms = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (4, 20, 41)]
    return randoms + [[1, 5, 9, 5, 9, 5, 9, 5], [1, 300, 7, 42, 300, 7, 42, 300]]  # repeats: n-gram drafts find them


@pytest.fixture(scope="module")
def references(random_checkpoints):
    """transformers' greedy tokens for each family's prompts, computed once per module."""
    return {name: hf_greedy(random_checkpoints[name], _prompts(name), GREEDY.max_tokens,
                            ATTENTION.get(name, "sdpa")) for name in FAMILY_MODEL_NAMES}


@pytest.mark.parametrize("name", FAMILY_MODEL_NAMES)
def test_family_matches_transformers_in_one_batch(random_checkpoints, references, name):
    built = Engine.from_pretrained(random_checkpoints[name], num_blocks=96, block_size=8)
    ours = [o.outputs[0].token_ids for o in built.generate(_prompts(name), GREEDY)]
    assert ours == references[name]


@pytest.mark.parametrize("name", FAMILY_MODEL_NAMES)
def test_family_matches_transformers_chunked_cached_and_speculative(random_checkpoints, references, name):
    """Prompts cut into chunks of 16 tokens, then the same prompts again (their full pages from the prefix
    cache), then again with drafts (the reference's own continuation) verified several rows at a time."""
    prompts, want = _prompts(name), [[tokens] for tokens in references[name]]
    settings = dict(max_num_batched_tokens=16, block_size=4, num_blocks=256, enable_prefix_caching=True)
    chunked = engine(random_checkpoints[name], **settings)
    assert tokens(run(chunked, prompts, GREEDY)) == want
    again = run(chunked, prompts, GREEDY)
    assert tokens(again) == want
    assert again[2].num_cached_tokens >= 40  # the 42-token prompt's full pages (a hit, not a recompute)
    script = {tuple(p): w for p, w in zip(prompts, references[name])}
    speculative = engine(random_checkpoints[name], proposer=ScriptProposer(script), **settings)
    assert tokens(run(speculative, prompts, GREEDY)) == want
    assert speculative.speculator.stats.num_accepted_tokens > 0


def test_longrope_takes_the_long_factors_past_the_original_context(random_checkpoints):
    config = load_model_config(random_checkpoints["phi3-longrope"])
    original = config.rope_scaling["original_max_position_embeddings"]
    cos, _ = rope_cos_sin(config, original + 8)
    short = torch.tensor(config.rope_scaling["short_factor"])
    long = torch.tensor(config.rope_scaling["long_factor"])
    dims = torch.arange(0, config.rotary_size, 2).float() / config.rotary_size
    factor = config.rope_scaling["attention_factor"]
    for position, factors in ((original - 1, short), (original, long), (original + 7, long)):
        inv_freq = 1.0 / (factors * config.rope_theta**dims)
        expected = torch.cos(position * inv_freq) * factor
        torch.testing.assert_close(cos[position, : config.rotary_size // 2], expected, rtol=1e-5, atol=1e-6)


def test_gemma3_windowed_layers_keep_their_own_rope_base(random_checkpoints):
    config = load_model_config(random_checkpoints["gemma3"])
    assert config.layer_windows == (24, None, 24) and config.local_rope_theta == 10_000.0
    assert [config.uses_local_rope(i) for i in range(3)] == [True, False, True]
    global_cos, _ = rope_cos_sin(config, 64)
    local_cos, _ = rope_cos_sin(config, 64, local=True)
    assert not torch.allclose(global_cos, local_cos)
    torch.testing.assert_close(local_cos[5, 0], torch.tensor(5.0).cos())  # base 10,000: the first pair turns 1/token


def test_the_engine_keeps_rope_rows_for_its_kv_slots_only(random_checkpoints):
    """A long-context model's tables are cut to the positions the pages can hold; the rows kept are unchanged."""
    path = random_checkpoints["gemma3"]  # two sets of tables: global and windowed
    config = load_model_config(path)
    built = Engine.from_pretrained(path, num_blocks=4, block_size=8)
    model = built.runner.model
    slots = 4 * 8
    if config.max_position_embeddings <= slots:
        raise AssertionError(f"the checkpoint's {config.max_position_embeddings} positions leave nothing to cut")
    for table, (full, _) in ((model.rope_cos, rope_cos_sin(config, config.max_position_embeddings)),
                             (model.local_rope_cos, rope_cos_sin(config, config.max_position_embeddings, local=True))):
        assert table.shape[0] == slots
        assert torch.equal(table, full[:slots])


def test_gemma2_logprobs_carry_the_final_soft_cap(random_checkpoints):
    """The final soft-cap keeps the argmax (tokens cannot show it); the logprobs must equal transformers'."""
    from transformers import AutoModelForCausalLM

    path = random_checkpoints["gemma2"]
    prompt = _prompts("gemma2")[1]
    built = Engine.from_pretrained(path, num_blocks=32, block_size=8)
    first = built.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0].outputs[0].logprobs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    for token_id, logprob in first.items():
        assert logprob == pytest.approx(float(expected[token_id]), abs=1e-4)


def test_a_multimodal_gemma3_folders_text_model_takes_gemma3s_defaults(tmp_path):
    """Published Gemma 3 4B-27B folders write a short text_config (what differs from Gemma3TextConfig's defaults)
    and prefix the text model's weights; both are read as transformers reads them."""
    from runtime.model.config import model_config_from_hf
    from runtime.model.llama import LlamaForCausalLM
    from runtime.model.loader import weight_target

    hf = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 1024,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}}
    config = model_config_from_hf(hf)
    shape = (config.model_type, config.head_dim, config.vocab_size, config.eos_token_ids)
    assert shape == ("gemma3_text", 256, 262208, (1, 106))
    assert config.attention_scale == 256**-0.5
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.layer_windows[:2] == (1024, 1024)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for prefix in ("language_model.model", "model.language_model"):  # older and transformers-5 folders
        key = f"{prefix}.layers.1.self_attn.q_norm.weight"
        assert weight_target(model, key)[0] is model.layers[1].self_attn.q_norm.weight
    assert weight_target(model, "model.vision_tower.vision_model.embeddings.patch_embedding.weight") is None
