"""The built-in demo model: a small Llama with seeded RANDOM weights and a byte tokenizer.

It exists so that everything runs with no checkpoint at all. Its output is noise: the
weights are random, not trained. It is named "demo-random-weights" wherever it appears.
"""

from __future__ import annotations

import torch

from runtime.model.config import ModelConfig
from runtime.model.llama import LlamaForCausalLM
from runtime.tokenizer import ByteTokenizer

DEMO_MODEL_NAME = "demo-random-weights"
DEMO_SEED = 1234


def demo_model_config() -> ModelConfig:
    tokenizer = ByteTokenizer()
    return ModelConfig(
        model_type="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
    )


def build_demo_model(device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The demo model with weights drawn from a fixed seed (same weights on every machine)."""
    config = demo_model_config()
    generator = torch.Generator().manual_seed(DEMO_SEED)
    model = LlamaForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.05, generator=generator)
    return model.place(device, dtype)
