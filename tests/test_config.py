"""Settings: defaults from TOML, a file, PAGEDSERVE_* variables, overrides; unknown keys named."""

import pytest

from config import ConfigError, load_settings


def test_defaults_come_from_default_toml():
    settings = load_settings(environ={})
    assert settings.engine.block_size == 16 and settings.server.port == 8000 and settings.server.model == "demo"


def test_file_then_environment_then_overrides(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[engine]\nblock_size = 32\nmax_num_seqs = 8\n[server]\nport = 9001\n")
    settings = load_settings(path, environ={"PAGEDSERVE_ENGINE_MAX_NUM_SEQS": "12", "PAGEDSERVE_SERVER_PORT": "9002"},
                             overrides={"server": {"port": 9003, "host": None}})
    assert settings.engine.block_size == 32 and settings.engine.max_num_seqs == 12
    assert settings.server.port == 9003 and settings.server.host == "127.0.0.1"


def test_unknown_keys_are_named(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[engine]\nblok_size = 32\n")
    with pytest.raises(ConfigError, match="blok_size"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match="PAGEDSERVE_ENGINE_NUM_BLOKS"):
        load_settings(environ={"PAGEDSERVE_ENGINE_NUM_BLOKS": "3"})
    with pytest.raises(ConfigError, match="servr"):
        load_settings(overrides={"servr": {"port": 1}})


def test_bad_values_are_errors():
    with pytest.raises(ConfigError, match="block_size"):
        load_settings(environ={}, overrides={"engine": {"block_size": 12}})
    with pytest.raises(ConfigError, match="port"):
        load_settings(environ={"PAGEDSERVE_SERVER_PORT": "not-a-number"})
    with pytest.raises(ConfigError, match="scheduling"):
        load_settings(environ={}, overrides={"engine": {"scheduling": "lottery"}})
    with pytest.raises(ConfigError, match="fair_input_weight"):
        load_settings(environ={}, overrides={"engine": {"fair_input_weight": -1.0}})
    assert load_settings(environ={"PAGEDSERVE_ENGINE_SCHEDULING": "fair"}).engine.scheduling == "fair"


def test_file_values_stay_strict_even_with_environment_overrides(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[server]\nport = "8000"\n')
    with pytest.raises(ConfigError, match="port"):
        load_settings(path, environ={"PAGEDSERVE_ENGINE_MAX_NUM_SEQS": "4"})


def test_speculative_config_takes_vllms_keys_from_toml_and_names_what_is_wrong(tmp_path):
    from config import parse_speculative_config

    path = tmp_path / "spec.toml"
    path.write_text('[engine.speculative_config]\nmethod = "ngram"\nnum_speculative_tokens = 3\nprompt_lookup_max = 2\n')
    spec = load_settings(path, environ={}).engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 1, 2)
    assert load_settings(environ={}).engine.speculative_config is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}').num_speculative_tokens == 4
    suffix = parse_speculative_config('{"method": "suffix", "suffix_decoding_max_cached_requests": 50}')
    assert (suffix.suffix_decoding_max_cached_requests, suffix.suffix_decoding_max_tree_depth) == (50, 24)
    draft = parse_speculative_config('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}')
    assert (draft.model, draft.draft_kv_cache_memory_bytes, draft.draft_num_blocks) == ("/m", 64 * 1024 * 1024, None)
    for bad, words in (('{"method": "eagle"}', "eagle"), ('{"method": "draft_model"}', "needs `model`"),
                       ('{"method": "ngram", "model": "x"}', "draft_model"), ('{"draft_num_blocks": 0}', "draft_num_blocks"),
                       ('{"method": "suffix", "suffix_decoding_max_tree_depth": 4}', "suffix_decoding_max_tree_depth"),
                       ('{"num_speculative_tokens": 0}', "num_speculative_tokens"), ('{"lookahead": 2}', "lookahead"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"), ("{", "")):
        with pytest.raises(ConfigError, match=words):
            parse_speculative_config(bad)
