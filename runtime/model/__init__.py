"""Llama-family models over paged K/V: config, weights, the demo model."""

from runtime.model.config import ModelConfig, UnsupportedModelError, load_model_config
from runtime.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModelError", "load_model_config"]
