"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and a cos/sin table.

The rotation itself is kernels/fused_ops.rope_qkv."""

from __future__ import annotations

import math

import torch

from runtime.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:  # float32 [head_dim // 2]
    """Per-pair rotation speeds, scaled as the checkpoint's rope type says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
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
    return inv_freq


def rope_cos_sin(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 [max_positions, head_dim], each half repeated."""
    inv_freq = inverse_frequencies(config)  # [head_dim // 2]
    positions = torch.arange(max_positions, dtype=torch.int64).float()  # [max_positions]
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return angles.cos(), angles.sin()
