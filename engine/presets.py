"""The shipped presets (configs/*.toml) and TOML config files, read but not yet built.

Apart from engine/config.py so that what builds a config (load_config) and what compares a
checkpoint with the presets (engine/checkpoint_settings.py) both read them one way.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from typing import Any

from jaxfill.models.config import ConfigError

NOT_PRESETS = {"hardware"}  # configs/hardware.toml holds accelerator specs, not a [model]/[engine]/[mesh] preset


def preset_names() -> list[str]:
    """Presets shipped in the `jaxfill.configs` package, read through importlib.resources."""
    names = (f.name[:-5] for f in resources.files("jaxfill.configs").iterdir() if f.name.endswith(".toml"))
    return sorted(n for n in names if n not in NOT_PRESETS)


def read_preset(config: str) -> tuple[str, dict[str, Any], str | None]:
    """(name, parsed TOML, the folder a `checkpoint = "..."` key is relative to) for a TOML
    path or a preset name ("tiny", "llama3_8b")."""
    if os.path.isfile(config):
        with open(config, "rb") as f:
            raw, base = f.read(), os.path.dirname(os.path.abspath(config))
        name = os.path.splitext(os.path.basename(config))[0]
    else:
        name = config[:-5] if config.endswith(".toml") else config
        if name not in preset_names():
            raise ConfigError(f"config {config!r} is neither a file nor a preset; presets: {', '.join(preset_names())}")
        package = resources.files("jaxfill.configs")
        raw, base = package.joinpath(name + ".toml").read_bytes(), str(package)
    try:
        return name, tomllib.loads(raw.decode()), base
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {config!r} is not valid TOML: {e}") from None
