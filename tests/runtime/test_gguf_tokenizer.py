"""A GGUF file's tokenizer, built in a child process by transformers' GGUF conversion (runtime/gguf_tokenizer.py):
the same tokenizer transformers builds in process, built once per file's metadata and then read from the cache."""

import shutil

import pytest

from runtime.gguf_tokenizer import cache_dir
from runtime.tokenizer import HFTokenizer, start_gguf_build

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "naïve café ☃ 日本語", "<|im_start|>user\nhi<|im_end|>",
         "1234567890 3.14159 -42", ""]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return cache_dir()


def test_the_child_builds_transformers_own_tokenizer(smollm2_gguf, cache):
    from transformers import AutoTokenizer

    ours = HFTokenizer.from_gguf(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.backend_tokenizer.encode(text).ids
    assert (ours.bos_token, ours.eos_token, ours.chat_template.source) == \
        (theirs.bos_token, theirs.eos_token, theirs.chat_template)
    assert ours.vocab_size == theirs.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def test_a_file_is_built_once_then_read_from_the_cache_also_as_a_copy(smollm2_gguf, cache, tmp_path):
    first = start_gguf_build(smollm2_gguf)
    assert not first.from_cache
    built = first.parts()
    assert len(list(cache.glob("*.json"))) == 1
    again = start_gguf_build(smollm2_gguf)
    assert again.from_cache and again.parts() == built
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(smollm2_gguf, copy)
    assert start_gguf_build(copy).from_cache  # the key is the metadata, not the path


def test_an_unreadable_cache_entry_is_built_again(smollm2_gguf, cache):
    built = start_gguf_build(smollm2_gguf).parts()
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    rebuilt = start_gguf_build(smollm2_gguf)
    assert not rebuilt.from_cache and rebuilt.parts() == built
    assert start_gguf_build(smollm2_gguf).from_cache


def test_the_child_finds_this_package_from_any_folder(smollm2_gguf, cache, tmp_path, monkeypatch):
    """A server started from a folder holding some other `runtime` package still builds with ours."""
    shadow = tmp_path / "elsewhere" / "runtime"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('a shadowing runtime package was imported')\n")
    monkeypatch.chdir(shadow.parent)
    assert start_gguf_build(smollm2_gguf).parts().tokenizer_json
