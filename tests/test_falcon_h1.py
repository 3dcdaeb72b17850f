"""Falcon-H1 (FalconH1ForCausalLM) is refused by name, with why: each of its layers runs
attention and Mamba2 in parallel, which needs KV pages and a state slot in one layer, and
the cache holds one entry per layer. Both ways in (config.json, a TOML [model] section)
say so before any weight is read."""

import pytest

from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry

tf = pytest.importorskip("transformers", reason="the config class as transformers saves it (the test extra)")


def test_falcon_h1_is_refused_with_its_reason():
    hf = dict(tf.FalconH1Config(num_hidden_layers=2).to_dict(), architectures=["FalconH1ForCausalLM"])
    with pytest.raises(ConfigError, match="'FalconH1ForCausalLM' is not supported: every Falcon-H1 layer runs "
                                          "attention and Mamba2 in parallel"):
        registry.config_from_hf(hf)
    with pytest.raises(ConfigError, match="KV pages and a state slot at once"):
        registry.config_from_dict({"architecture": "FalconH1ForCausalLM"})
    assert "FalconH1ForCausalLM" not in registry.architectures()
