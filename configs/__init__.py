"""TOML presets shipped with jaxfill; `engine.config.load_config` finds them by name."""
