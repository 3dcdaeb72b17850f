"""DeepSeek V4 (DeepseekV4ForCausalLM) is refused by name, with what is missing: it runs in
transformers 5.25 on CPU, but hyper-connections, compressed (CSA / HCA) attention beside a
sliding window, attention sinks, the grouped output projection and hash-routed MoE are each
a new part, not an option of V3.2's MLA and MoE. Both ways in (config.json, a TOML [model]
section) say so before any weight is read."""

import pytest

from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry

tf = pytest.importorskip("transformers", reason="the config class as transformers saves it (the test extra)")


def test_deepseek_v4_is_refused_with_what_is_missing():
    hf = dict(tf.DeepseekV4Config(num_hidden_layers=4).to_dict(), architectures=["DeepseekV4ForCausalLM"])
    with pytest.raises(ConfigError, match="'DeepseekV4ForCausalLM' is not supported: DeepSeek V4 is not V3.2"):
        registry.config_from_hf(hf)
    with pytest.raises(ConfigError, match="hyper-connections .* compressed attention .* hash-routed MoE"):
        registry.config_from_dict({"architecture": "DeepseekV4ForCausalLM"})
    assert "DeepseekV4ForCausalLM" not in registry.architectures()
