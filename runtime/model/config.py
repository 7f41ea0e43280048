"""The architecture of a Llama-family checkpoint, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this runtime can run (named with the reason)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama/Mistral/Qwen2 decoder, independent of Hugging Face."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # rope_type and its parameters
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size

    def check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {self.rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(hf: dict) -> tuple[float, dict]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older keys."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or legacy
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    return theta, scaling


def model_config_from_hf(hf: dict, generation_config: dict | None = None) -> ModelConfig:
    """Map a Hugging Face config dict (and generation_config) onto ModelConfig."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    num_heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
        sliding_window = None
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window") if model_type == "mistral" else None
    generation_config = generation_config or {}
    eos = generation_config.get("eos_token_id", hf.get("eos_token_id"))
    config = ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        bos_token_id=generation_config.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_ids=_as_tuple(eos),
    )
    config.check()
    return config


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json if present) from a checkpoint folder."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json; expected a Hugging Face checkpoint folder")
    hf = json.loads(config_path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return model_config_from_hf(hf, generation_config)
