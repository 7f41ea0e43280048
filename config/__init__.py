"""Settings for every part: msgspec Structs, defaults in default.toml."""

from config.settings import ConfigError, EngineSettings, load_engine_settings

__all__ = ["ConfigError", "EngineSettings", "load_engine_settings"]
