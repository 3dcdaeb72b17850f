"""Flax NNX model definitions. Only logical axis names here; mesh axes live in sharding.py."""

from jaxfill.models.config import ConfigError, ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata, KVCache
from jaxfill.models.llama import Llama

__all__ = ["ConfigError", "ModelConfig", "AttentionMetadata", "KVCache", "Llama"]
