"""What an embedding checkpoint's files set at config time, and what is refused there: no
weights, no torch (a tiny_random checkpoint written here)."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.pooling.api import pooling_params
from jaxfill.engine.request import InvalidRequest
from jaxfill.models.config import ConfigError, ModelConfig

HF = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def checkpoint(d, modules=None, pooling=None, lm_head=True) -> str:
    from safetensors.numpy import save_file

    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(HF, f)
    save_file({"embed_tokens.weight": np.zeros((64, 32), np.float32),
               **({"lm_head.weight": np.zeros((64, 32), np.float32)} if lm_head else {})},
              os.path.join(d, "model.safetensors"))
    if modules is not None:
        with open(os.path.join(d, "modules.json"), "w") as f:
            json.dump([{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                       for i, (t, p) in enumerate(modules)], f)
    if pooling is not None:
        os.makedirs(os.path.join(d, "1_Pooling"))
        with open(os.path.join(d, "1_Pooling", "config.json"), "w") as f:
            json.dump(pooling, f)
    return str(d)


ST = [("Transformer", ""), ("Pooling", "1_Pooling")]


def test_modules_json_sets_pooling_and_normalize(tmp_path):
    d = checkpoint(tmp_path, ST + [("Normalize", "2_Normalize")], {"pooling_mode_mean_tokens": True})
    m = load_config(None, {"engine.num_pages": 8}, d).model
    assert (m.pooling.mode, m.pooling.normalize, m.embeddings.head) == ("mean", True, True)
    m = load_config(None, {"engine.num_pages": 8, "model.pooling": "cls", "model.normalize_embeddings": False},
                    d).model
    assert (m.pooling.mode, m.pooling.normalize) == ("cls", False)  # overrides win


def test_a_checkpoint_without_lm_head_is_headless_and_needs_pooling(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    d = checkpoint(tmp_path / "a", ST, {"pooling_mode_lasttoken": True}, lm_head=False)
    m = load_config(None, {"engine.num_pages": 8}, d).model
    assert (m.pooling.mode, m.pooling.normalize, m.embeddings.head) == ("last", False, False)
    with pytest.raises(ConfigError, match="model.pooling"):
        load_config(None, {"engine.num_pages": 8}, checkpoint(tmp_path / "b", lm_head=False))


@pytest.mark.parametrize("modules,pooling", [(ST + [("Dense", "2_Dense")], {"pooling_mode_lasttoken": True}),
                                             (ST, {"pooling_mode_max_tokens": True}),
                                             (ST, {"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True})],
                         ids=["dense", "max", "two"])
def test_modules_not_built_are_refused(tmp_path, modules, pooling):
    with pytest.raises(ConfigError, match="not built"):
        load_config(None, {"engine.num_pages": 8}, checkpoint(tmp_path, modules, pooling))


def test_pooling_keys_and_refusals():
    assert ModelConfig.of(score_token_ids=[3, 4]).pooling.enabled
    assert not ModelConfig().pooling.enabled
    for bad in ({"pooling": "max"}, {"score_token_ids": [1]}, {"num_labels": -1}):
        with pytest.raises(ConfigError):
            ModelConfig.of(**bad)
    engine = types.SimpleNamespace(config=types.SimpleNamespace(model=ModelConfig()))
    with pytest.raises(InvalidRequest, match="model.pooling"):
        pooling_params(engine, None, None)
    engine.config.model = ModelConfig.of(score_token_ids=[3, 4])  # a reranker: embed names its pooling
    with pytest.raises(InvalidRequest, match="name last, mean or cls"):
        pooling_params(engine, None, None)
    assert pooling_params(engine, "mean", True).mode == "mean"


def test_chunk_sums_after_a_recompute_tile_the_prompt_once():
    """A preempted mean-pooling request recomputes from 0: the sums of its first pass are
    dropped, not added twice; last-token pooling may start after a cached prefix."""
    from jaxfill.engine.pooling.vectors import add_part, vector
    from jaxfill.engine.request import PoolingParams

    rows = np.arange(10 * 4, dtype=np.float64).reshape(10, 4)
    req = types.SimpleNamespace(request_id="r", prompt_ids=list(range(10)), pool_parts=[],
                                pooling=PoolingParams("mean"))
    add_part(req, 0, 4, rows[:4].sum(0))
    add_part(req, 4, 4, rows[4:8].sum(0))
    add_part(req, 0, 6, rows[:6].sum(0))  # preempted: again from the start, in other chunks
    with pytest.raises(RuntimeError, match="do not cover"):
        vector(req)
    add_part(req, 6, 4, rows[6:].sum(0))
    np.testing.assert_allclose(vector(req), rows.mean(0), rtol=1e-6)
    req.pooling, req.pool_parts = PoolingParams("last", normalize=True), []
    add_part(req, 8, 2, rows[9])  # the first 8 tokens came from the prefix cache
    np.testing.assert_allclose(vector(req), rows[9] / np.linalg.norm(rows[9]), rtol=1e-6)
    req.pooling, req.pool_parts = PoolingParams("mean"), []
    add_part(req, 8, 2, rows[8:].sum(0))
    with pytest.raises(RuntimeError, match="do not cover"):
        vector(req)
