"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope, a GGUF file's per-pair
factors) and cos/sin tables.

The rotation itself is kernels/fused_ops.rope_qkv. A table covers the `rotary_size` first dims
of each head (all of head_dim but for partial rotary, as Phi-4-mini's). Gemma 3's windowed
layers rotate with their own base: `rope_cos_sin(config, n, local=True)`.

LongRoPE (Phi-3) scales each frequency by a per-dim factor, the short factors up to the
original context and the long ones past it, and cos/sin by an attention factor. transformers
picks one set for the whole sequence by its current length; here each position takes its own
(the set it would get in a sequence that ends there), so a cached key never changes.
"""

from __future__ import annotations

import math

import torch

from runtime.model.config import ModelConfig


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:  # float32 [dim // 2]
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:  # float32 [rotary_size // 2]
    """Per-pair rotation speeds of the global layers, scaled as the checkpoint's rope type says.

    `long`: LongRoPE's long factors (positions past the original context) instead of the short ones.
    """
    dim = config.rotary_size
    scaling = config.rope_scaling
    if config.rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = _base_frequencies(config.rope_theta, dim)
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if config.rope_type == "freq_factors":  # a GGUF file's rope_freqs: each pair's speed divided by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} rotary pairs")
        return inv_freq / factors
    return inv_freq


def _table(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None] * inv_freq[None, :]  # [positions, rotary_size // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [positions, rotary_size]
    return angles.cos(), angles.sin()


def rope_cos_sin(config: ModelConfig, max_positions: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 [max_positions, rotary_size], each half repeated.

    `local`: the windowed layers' tables (their own base, no scaling), for a config with local_rope_theta.
    """
    positions = torch.arange(max_positions, dtype=torch.int64).float()  # [max_positions]
    if local:
        return _table(_base_frequencies(config.local_rope_theta, config.rotary_size), positions)
    if config.rope_type != "longrope":
        return _table(inverse_frequencies(config), positions)
    original = config.rope_scaling["original_max_position_embeddings"]
    attention_factor = config.rope_scaling["attention_factor"]
    cos, sin = _table(inverse_frequencies(config), positions)
    if max_positions > original:
        cos_long, sin_long = _table(inverse_frequencies(config, long=True), positions)
        cos[original:], sin[original:] = cos_long[original:], sin_long[original:]
    return cos * attention_factor, sin * attention_factor
