"""speculative.method = "mtp" in the model's config: what the checkpoint must hold."""

from __future__ import annotations

from jaxfill.models.config import ConfigError, ModelConfig


def mtp_model(model: ModelConfig, speculative) -> ModelConfig:
    """The model runs its first multi-token-prediction layer too (ModelConfig.run_mtp,
    models/mtp.py), which the checkpoint must declare; one proposal per decode."""
    if not model.mtp_layers:
        raise ConfigError(f"speculative.method = 'mtp' needs the checkpoint's multi-token-prediction layer, and "
                          f"this {model.architecture} has none (config.json num_nextn_predict_layers or "
                          "mtp_num_hidden_layers is 0 or absent): use speculative.method = ngram, suffix or none")
    if int(speculative.num_tokens) != 1:
        raise ConfigError(f"speculative.method = 'mtp' proposes one token per decode (the layer chained on its own "
                          f"output is not built yet): set speculative.num_tokens = 1, got {speculative.num_tokens}")
    return model.replace(run_mtp=True)
