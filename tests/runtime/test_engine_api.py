"""The engine's public calls: add/step/abort, errors, stats, the demo model."""

import pytest

from runtime import Engine, InvalidRequestError, SamplingParams


@pytest.fixture
def engine(stories_dir):
    return Engine.from_pretrained(stories_dir, num_blocks=32)


def test_stats_have_the_documented_keys(engine):
    stats = engine.stats()
    for key in ("block_size", "num_blocks", "num_free_blocks", "num_cached_blocks", "num_kv_tokens", "num_running",
                "num_waiting", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert key in stats
    assert stats["num_blocks"] == stats["num_free_blocks"] == 32 and stats["block_size"] == 16


def test_step_reports_new_tokens_each_step(engine, golden):
    case = golden["cases"][0]
    engine.add_request("a", case["prompt"], SamplingParams(max_tokens=5, temperature=0))
    seen = []
    while engine.has_unfinished_requests():
        (output,) = engine.step()
        seen += output.outputs[0].new_token_ids
        # deltas each step; the final output also carries the whole
        assert output.outputs[0].token_ids == (seen if output.finished else [])
    assert seen == case["greedy_30_new_ids"][:5] and output.finished


def test_abort_frees_pages_at_once_and_reports_abort(engine):
    for i in range(3):
        engine.add_request(f"r{i}", [1, 5, 6, 7] * 10, SamplingParams(max_tokens=50, temperature=0))
    for _ in range(4):
        engine.step()
    used = engine.stats()["num_used_blocks"]
    assert engine.abort_request("r1")
    assert engine.stats()["num_used_blocks"] < used
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["r1"].finished and outputs["r1"].outputs[0].finish_reason == "abort"
    assert not engine.abort_request("r1")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_free_blocks"] == 32
    engine.check_invariants()


def test_context_length_exceeded_is_a_typed_error(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("long", [1] * 500, SamplingParams(max_tokens=20))
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_request_larger_than_the_cache_is_refused(stories_dir):
    small = Engine.from_pretrained(stories_dir, num_blocks=2)
    with pytest.raises(InvalidRequestError):
        small.add_request("big", [1] * 30, SamplingParams(max_tokens=10))


@pytest.mark.parametrize(
    "prompt, param", [([], "prompt"), ([1, 99999], "prompt"), ([1, -1], "prompt"), ([1, "a"], "prompt"),
                      ([1, True], "prompt"), ([1, 2.0], "prompt"), ([1, None], "prompt")]
)
def test_bad_prompts_name_the_param(engine, prompt, param):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, SamplingParams())
    assert info.value.param == param


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", -0.1), ("top_p", 1.5), ("max_tokens", -1), ("n", 0), ("top_k", -2), ("logprobs", 50),
     ("presence_penalty", 3.0), ("stop", [""])],
)
def test_bad_sampling_params_name_the_param(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("same", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        engine.add_request("same", [1, 2, 3], SamplingParams(max_tokens=2))


def test_kv_memory_is_sized_from_a_byte_budget(stories_dir):
    # stories260K: 5 layers * 2 (K, V) * 4 kv heads * 8 dims * 4 bytes = 1280 bytes per token
    engine = Engine.from_pretrained(stories_dir, kv_cache_memory_bytes=1280 * 16 * 100)
    assert engine.num_blocks == 100
    assert engine.runner.kv_cache.numel() * 4 == 1280 * 16 * 100


def test_demo_model_runs_without_a_checkpoint_and_says_it_is_random():
    engine = Engine.from_pretrained("demo", num_blocks=16)
    assert "random" in engine.model_name
    out = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    again = Engine.from_pretrained("demo", num_blocks=16).generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # seeded weights: same everywhere


def test_chat_prompt_falls_back_to_role_lines(stories_dir):
    from runtime.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(stories_dir)
    assert tokenizer.chat_template.is_fallback
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == "user: Hi\nassistant:"


def test_chat_template_from_tokenizer_config_is_used(tmp_path, stories_dir):
    import json
    import shutil

    from runtime.tokenizer import HFTokenizer

    shutil.copy(stories_dir / "tokenizer.json", tmp_path)
    config = json.loads((stories_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(tmp_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 1  # one BOS, from the template
    assert tokenizer.decode(ids) == "[user] Hi\n[bot]"


def test_max_tokens_zero_ends_at_once_with_length_and_no_tokens(engine):
    engine.add_request("zero", [1, 5, 6, 7], SamplingParams(max_tokens=0))
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outputs] == [
        ("zero", True, "length", [])]
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


def test_top_p_zero_keeps_only_the_most_probable_token(engine):
    prompt = [1, 403, 407, 261]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    top_p0 = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.5, top_p=0.0, seed=5,
                                                      ignore_eos=True))[0]
    assert top_p0.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_n_past_max_num_seqs_is_refused_naming_n():
    engine = Engine.from_pretrained("demo", num_blocks=16, max_num_seqs=2)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("many", [1, 2, 3], SamplingParams(n=3, max_tokens=2))
    assert info.value.param == "n" and "max_num_seqs" in info.value.message
