"""The architecture of a decoder checkpoint, read from its Hugging Face config.json.

One decoder (runtime/model/llama.py) runs every family here; what differs between families is
data in ModelConfig, not code per model:

    family        norms                 MLP        attention extras                      rope
    llama         RMSNorm w             SwiGLU     -                                     default, linear, llama3
    mistral       RMSNorm w             SwiGLU     sliding window (every layer)          default
    qwen2         RMSNorm w             SwiGLU     q/k/v bias                            default
    qwen3         RMSNorm w, q/k norms  SwiGLU     per-head RMSNorm on q and k           default
    gemma2        (1 + w), sandwich     GeGLU      scale 1/sqrt(query_pre_attn_scalar),  default
                                                   soft-capped scores and logits,
                                                   sliding window on every other layer
    gemma3_text   (1 + w), sandwich,    GeGLU      as gemma2 without soft-caps; 5 of 6   global: rope_theta (+ scaling),
                  q/k norms                        layers windowed                       local: its own base
    phi3          RMSNorm w             SwiGLU     fused qkv / gate_up in the file       longrope, partial rotary

Gemma's (1 + w) norms are stored as (1 + w) once at load (GGUF files already hold 1 + w), so
every norm is the same kernel.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")  # the last: GGUF's rope_freqs
SUPPORTED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA_TYPES = ("gemma2", "gemma3_text")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this runtime can run (named with the reason)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder of any supported family, independent of Hugging Face."""

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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # --- what differs between families (the table at the top) ---
    hidden_act: str = "silu"  # silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_weight_offset: float = 0.0  # Gemma: norms scale by (1 + w); added to the weights at load from a folder
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before rope
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too, before each residual add
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power (default: head_dim's)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # the same on the logits
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, or None; () = no layer has one
    local_rope_theta: float | None = None  # windowed layers' own rope base (default rope), where they differ
    rotary_dim: int | None = None  # dims of each head that rotate (the first ones); None = all of head_dim

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None where it attends to every position."""
        return self.layer_windows[layer] if self.layer_windows else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the windowed layers' own base (Gemma 3's local layers)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    @functools.cached_property  # asked every step (runtime/model_runner.py); a frozen dataclass still caches it
    def windows(self) -> tuple[int | None, ...]:
        """Each distinct window of the layers (None: full attention), in layer order."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

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
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.rotary_size % 2 or self.rotary_size > self.head_dim:
            raise UnsupportedModelError(f"rotary dims {self.rotary_size} must be even and at most head_dim "
                                        f"{self.head_dim}")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(params: dict, hf: dict) -> tuple[float, dict]:
    """(theta, scaling) from one rope parameter dict (transformers 5's `rope_parameters`) or the older keys."""
    params = dict(params)
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    scaling = params or legacy
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type") == "su":  # Phi-3's early name for longrope
        scaling["rope_type"] = "longrope"
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type") == "default":
        scaling = {}
    if scaling.get("rope_type") == "longrope":
        scaling = _longrope(scaling, hf)
    return theta, scaling


def _longrope(scaling: dict, hf: dict) -> dict:
    """LongRoPE's parameters made whole: the original context and the cos/sin attention factor."""
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") \
        or hf["max_position_embeddings"]
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # the paper's default, as transformers computes it
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]],
            "original_max_position_embeddings": int(original),
            "attention_factor": float(attention_factor)}


def _layer_windows(hf: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), from `layer_types` or the family's rule."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        if model_type == "gemma2":  # every other layer windowed, the first one too
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif model_type == "gemma3_text":
            pattern = hf.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif model_type in ("mistral", "phi3"):
            types = ["sliding_attention"] * num_layers
        elif model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            first = hf.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            return ()
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported "
                                    "(sliding_attention, full_attention)")
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def _gemma3_text_config(hf: dict) -> dict:
    """A multimodal Gemma 3 config's text model, its fields made whole by transformers' own Gemma3TextConfig
    (published folders write only what differs from its defaults: head_dim, rope bases, query_pre_attn_scalar)."""
    from transformers import Gemma3TextConfig

    text = dict(hf["text_config"])
    for key in ("bos_token_id", "eos_token_id"):
        text.setdefault(key, hf.get(key))
    text.pop("model_type", None)
    return {**Gemma3TextConfig(**text).to_dict(), "model_type": "gemma3_text"}


def model_config_from_hf(hf: dict, generation_config: dict | None = None) -> ModelConfig:
    """Map a Hugging Face config dict (and generation_config) onto ModelConfig."""
    if hf.get("model_type") == "gemma3" and "text_config" in hf:  # the multimodal folder: its text model
        hf = _gemma3_text_config(hf)
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        model_type = "gemma3_text"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {activation!r} is not supported ({', '.join(SUPPORTED_ACTIVATIONS)})")
    num_heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    gemma = model_type in GEMMA_TYPES
    rope_parameters = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:  # per layer type (Gemma 3)
        theta, scaling = _rope(rope_parameters.get("full_attention", {}), hf)
        if "sliding_attention" in rope_parameters:
            local_theta, local_scaling = _rope(rope_parameters["sliding_attention"], hf)
            if local_scaling:
                raise UnsupportedModelError(f"scaled rope on windowed layers ({local_scaling}) is not supported")
    else:
        theta, scaling = _rope(rope_parameters, hf)
        if model_type == "gemma3_text":
            local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = hf.get("rotary_dim") or (round(head_dim * partial) if partial != 1.0 else None)  # a GGUF's count
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
    layer_windows = _layer_windows(hf, model_type, num_layers)
    generation_config = generation_config or {}
    eos = generation_config.get("eos_token_id", hf.get("eos_token_id"))
    config = ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        bos_token_id=generation_config.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_ids=_as_tuple(eos),
        hidden_act=SUPPORTED_ACTIVATIONS[activation],
        norm_weight_offset=1.0 if gemma else 0.0,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sandwich_norms=gemma,
        embedding_scale=float(hf["hidden_size"]) ** 0.5 if gemma else None,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
        layer_windows=layer_windows,
        local_rope_theta=local_theta,
        rotary_dim=rotary_dim,
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
