"""Reading a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxfill.models.config.errors import ConfigError


def read_config_json(path: str) -> dict[str, Any]:
    """A model directory (or its config.json) -> dict; every way it can be wrong is a ConfigError."""
    if not os.path.exists(path):
        raise ConfigError(f"model directory {path!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} has no config.json: --model wants a Hugging Face model directory")
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config
