"""Flax NNX model definitions. Only logical axis names here; mesh axes live in sharding.py."""

from jaxfill.models.config import ConfigError, ModelConfig
from jaxfill.models.decoder import Decoder
from jaxfill.models.kv_cache import AttentionMetadata, KVCache

Llama = Decoder  # the name before the registry (models/families/): every dense family's model

__all__ = ["ConfigError", "ModelConfig", "AttentionMetadata", "KVCache", "Decoder", "Llama"]
