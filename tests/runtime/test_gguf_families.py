"""GGUF files of every further family give transformers' greedy tokens for the Hugging Face model they were
written from (float32 tensors): files laid out by tests/gguf_files.py as llama.cpp's converter does, and
files written by llama.cpp's converter itself (its source from llama-cpp-python's sdist)."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.model.gguf_file import GGUFCheckpoint
from runtime.model.rope import inverse_frequencies
from runtime.model.config import load_model_config
from tests.conftest import REPO, hf_greedy
from tests.gguf_files import GGUF_ARCH, family_gguf, write_gguf

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ATTENTION = {"gemma2": "eager"}


def _prompts(name: str) -> list[list[int]]:
    rng = random.Random(f"gguf-{name}")
    return [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 37)]


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_gguf_family_matches_transformers(random_checkpoints, stories_dir, tmp_path, name):
    folder, path = family_gguf(random_checkpoints[name], name, tmp_path, "F32", stories_dir / "tokenizer.model")
    built = Engine.from_pretrained(path, quantization="none", num_blocks=64, block_size=8)
    ours = [o.outputs[0].token_ids for o in built.generate(_prompts(name), GREEDY)]
    assert ours == hf_greedy(folder, _prompts(name), GREEDY.max_tokens, ATTENTION.get(name, "sdpa"))


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_gguf_family_config_equals_the_folders(random_checkpoints, stories_dir, tmp_path, name):
    """What the file's metadata (and llama.cpp's fixed rules) say is what config.json says."""
    folder, path = family_gguf(random_checkpoints[name], name, tmp_path, "F32", stories_dir / "tokenizer.model")
    from_file, from_folder = GGUFCheckpoint(path).model_config(), load_model_config(folder)
    same = ("model_type", "hidden_act", "qk_norm", "sandwich_norms", "norm_weight_offset", "embedding_scale",
            "attention_scale", "attn_logit_softcap", "final_logit_softcap", "layer_windows", "local_rope_theta",
            "rotary_size", "tie_word_embeddings", "head_dim")
    assert {f: getattr(from_file, f) for f in same} == {f: getattr(from_folder, f) for f in same}
    if name == "gemma3":
        assert from_file.layer_windows == (24,) * 5 + (None, 24)
    torch.testing.assert_close(inverse_frequencies(from_file), inverse_frequencies(from_folder), rtol=1e-6, atol=0)


GEMMA_KEYS = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def test_a_gemma2_file_without_window_or_caps_gets_llama_cpps_defaults(random_checkpoints, stories_dir, tmp_path):
    """llama.cpp windows a Gemma 2 file that names no window at 4,096 and caps it at 50 / 30 (Gemma 2's
    published values); with the keys written, the file's own values are read (the test model's differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_checkpoints["gemma2"], dtype=torch.float32)
    bare = GGUFCheckpoint(write_gguf(tmp_path / "bare.gguf", model, "gemma2", "F32", stories_dir / "tokenizer.model",
                                     omit=GEMMA_KEYS)).model_config()
    assert (bare.attn_logit_softcap, bare.final_logit_softcap) == (50.0, 30.0)
    assert bare.layer_windows == tuple(4096 if i % 2 == 0 else None for i in range(bare.num_layers))
    full = GGUFCheckpoint(write_gguf(tmp_path / "full.gguf", model, "gemma2", "F32",
                                     stories_dir / "tokenizer.model")).model_config()
    assert (full.attn_logit_softcap, full.final_logit_softcap, full.window(0)) == (
        model.config.attn_logit_softcapping, model.config.final_logit_softcapping, model.config.sliding_window)
    assert (full.attn_logit_softcap, full.window(0)) != (50.0, 4096)


def test_a_gemma3_file_without_a_window_windows_no_layer(random_checkpoints, stories_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_checkpoints["gemma3"], dtype=torch.float32)
    config = GGUFCheckpoint(write_gguf(tmp_path / "bare.gguf", model, "gemma3", "F32", stories_dir / "tokenizer.model",
                                       omit=("sliding_window",))).model_config()
    assert config.layer_windows == () and not config.uses_local_rope(0)
    assert config.final_logit_softcap is None and config.attn_logit_softcap is None


# --- files written by llama.cpp's own converter ------------------------------------------------

CONVERTED = ("qwen3", "gemma2", "gemma3-pattern", "phi3-longrope", "llama3-rope")


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    """llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py), from llama-cpp-python's sdist on PyPI."""
    result = subprocess.run(["bash", str(REPO / "bench" / "peers" / "llama_cpp.sh"), "--source-only"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHON": sys.executable})
    if result.returncode != 0:
        pytest.fail(f"could not fetch llama.cpp's source: {result.stderr[-2000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def _folder(random_checkpoints, stories_dir, tmp_path, name) -> Path:
    """A Hugging Face folder llama.cpp's converter reads (sentencepiece vocabulary); Gemma as in tests/gguf_files.family_gguf."""
    from transformers import AutoModelForCausalLM

    if name == "gemma3-pattern":  # the real layer pattern, which the converter does not write down
        folder, _ = family_gguf(random_checkpoints["gemma3"], "gemma3", tmp_path, "F32", stories_dir / "tokenizer.model")
    else:
        folder = random_checkpoints[name]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if getattr(model.config, "query_pre_attn_scalar", None) is not None:
            model.config.query_pre_attn_scalar = model.config.head_dim
        folder = tmp_path / f"{name}-hf"
        model.save_pretrained(folder)
    for file in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories_dir / file, folder / file)
    return folder


@pytest.mark.parametrize("name", CONVERTED)
def test_llama_cpp_converted_family_matches_transformers(random_checkpoints, stories_dir, tmp_path,
                                                         llama_cpp_source, name):
    folder = _folder(random_checkpoints, stories_dir, tmp_path, name)
    path = tmp_path / f"{name}.gguf"
    result = subprocess.run([sys.executable, str(llama_cpp_source / "convert_hf_to_gguf.py"), str(folder),
                             "--outtype", "f32", "--outfile", str(path)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(llama_cpp_source / "gguf-py")})
    assert result.returncode == 0, result.stderr[-2000:]
    built = Engine.from_pretrained(path, quantization="none", num_blocks=64, block_size=8)
    prompts = _prompts(name)
    ours = [o.outputs[0].token_ids for o in built.generate(prompts, GREEDY)]
    assert ours == hf_greedy(folder, prompts, GREEDY.max_tokens, ATTENTION.get(name, "sdpa"))
