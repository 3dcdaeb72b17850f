"""Flax NNX model definitions. Only logical axis names here; mesh axes live in sharding.py."""

from models.config import ConfigError, ModelConfig
from models.kv_cache import AttentionMetadata, KVCache
from models.llama import Llama

__all__ = ["ConfigError", "ModelConfig", "AttentionMetadata", "KVCache", "Llama"]
