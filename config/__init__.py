"""Settings for every part: msgspec Structs, defaults in default.toml."""

from config.settings import (
    ConfigError,
    DistributedSettings,
    EngineSettings,
    ServerSettings,
    Settings,
    load_engine_settings,
    load_settings,
)

__all__ = ["ConfigError", "DistributedSettings", "EngineSettings", "ServerSettings", "Settings", "load_engine_settings", "load_settings"]
