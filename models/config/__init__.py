"""The model config: `ModelConfig` (model.py) and its sections (sections.py)."""

from jaxfill.models.config.errors import ConfigError
from jaxfill.models.config.hf_json import read_config_json
from jaxfill.models.config.model import (DTYPES, FLAT_KEYS, WEIGHT_DTYPES, ModelConfig, as_tuple, flat_keys,
                                         freeze)
from jaxfill.models.config.sections import (LAYER_TYPES, AttentionConfig, EmbeddingConfig, LinearConfig, MLAConfig,
                                            MoEConfig, NormConfig)
from jaxfill.models.config.pooling import PoolingConfig

__all__ = ["ConfigError", "read_config_json", "DTYPES", "FLAT_KEYS", "WEIGHT_DTYPES", "ModelConfig", "as_tuple",
           "flat_keys", "freeze", "LAYER_TYPES", "AttentionConfig", "EmbeddingConfig", "LinearConfig", "MLAConfig",
           "MoEConfig", "NormConfig", "PoolingConfig"]
