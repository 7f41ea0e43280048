"""Settings for every part: msgspec Structs, defaults in default.toml."""

from config.settings import (
    ConfigError,
    DistributedSettings,
    EngineSettings,
    SPECULATIVE_METHODS,
    ServerSettings,
    Settings,
    SpeculativeConfig,
    load_engine_settings,
    load_settings,
    parse_speculative_config,
)

__all__ = ["ConfigError", "DistributedSettings", "EngineSettings", "SPECULATIVE_METHODS", "ServerSettings", "Settings",
           "SpeculativeConfig", "load_engine_settings", "load_settings", "parse_speculative_config"]
