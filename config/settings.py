"""Typed settings (msgspec Structs) with defaults read from config/default.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

DEFAULT_TOML = Path(__file__).with_name("default.toml")


class ConfigError(ValueError):
    """A setting is unknown or has a bad value (the message names it)."""


class EngineSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the engine sizes its KV cache and batches."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    kernel_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"engine.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"engine.num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ConfigError("engine.kv_cache_memory_bytes must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError(f"engine.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"engine.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"engine.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")


def load_engine_settings(path: str | Path | None = None, **overrides) -> EngineSettings:
    """Defaults from default.toml, then `path`'s [engine] table, then keyword overrides (None = unset)."""
    table = tomllib.loads(DEFAULT_TOML.read_text()).get("engine", {})
    if path is not None:
        table.update(tomllib.loads(Path(path).read_text()).get("engine", {}))
    table.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(table, EngineSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"engine settings: {exc}") from exc
