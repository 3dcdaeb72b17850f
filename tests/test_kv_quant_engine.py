"""Quantized KV engines (engine.kv_cache_dtype = int8 / float8_e4m3fn) are invariant:
chunked = cached = sharded = the plain prefill-then-decode loop, for the same quantized
config, on NaN-filled caches (unused pages 0, unused scales NaN). And the cache really is
quantized: int8/fp8 values with f32 scales, bytes as stated."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.simple import generate_one
from jaxfill.models.kv_cache import KVCache
from jaxfill.pallas_kernels import QuantizedPages
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

KV_DTYPES = ["int8", "float8_e4m3fn"]
BASE = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 256, "engine.page_size": 8}
GREEDY = SamplingParams(max_tokens=6, logprobs=1)
LOGPROB_TOL = 1e-3  # measured: see test_quantized_engine_chunked_cached_plain_agree
PROMPTS = [list(range(40, 77)), list(range(100, 119)) * 2, [7, 8, 9, 10, 11]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_engine(kv_dtype, **overrides):
    return Engine.from_config("tiny_random", overrides={**BASE, "engine.kv_cache_dtype": kv_dtype,
                                                        "engine.kv_fill_value": float("nan"), **overrides},
                              progress=False)


def logprobs(completions):
    return np.asarray([[e["logprob"] for e in c.logprobs] for c in completions])


def plain_tokens(eng, kv_dtype):
    """engine/simple.py's one-prompt-at-a-time loop on a fresh NaN-filled quantized cache."""
    from flax import nnx

    model = nnx.merge(eng.runner.graphdef, eng.runner.state)
    out = []
    for p in PROMPTS:
        cache = KVCache.create(model.config, 32, BASE["engine.page_size"], fill_value=float("nan"),
                               kv_cache_dtype=kv_dtype)
        tokens, _ = generate_one(model, p, cache, GREEDY.max_tokens)
        out.append(tokens)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_engine_chunked_cached_plain_agree(kv_dtype):
    # fp8 through xla's per-block dequantization; int8 on the reference impl (cheaper to
    # compile, tests/fast_engine.py): both impls read quantized pages in an engine
    eng = make_engine(kv_dtype, **(REFERENCE_ATTENTION if kv_dtype == "int8" else {}))
    layer = eng.runner.kv_cache.pages[0]
    assert isinstance(layer, QuantizedPages) and layer.values.dtype == jnp.dtype(kv_dtype)
    done = eng.generate(PROMPTS, GREEDY)
    first, first_lp = [c.token_ids for c in done], logprobs(done)
    # Written slots hold finite scales; the NaN fill survives everywhere else.
    scales = np.asarray(eng.runner.kv_cache.pages[0].scales)
    assert np.isfinite(scales[1:4]).any() and np.isnan(scales[-1]).all()
    hits = eng.stats()["prefix_cache_hits"]
    cached = eng.generate(PROMPTS, GREEDY)
    assert eng.stats()["prefix_cache_hits"] > hits  # the second pass read cached quantized pages
    assert [c.token_ids for c in cached] == first
    chunked = make_engine(kv_dtype, **{"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]})
    chunked = chunked.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in chunked] == first
    print("max |dlogprob| cached", np.abs(logprobs(cached) - first_lp).max(),
          "chunked", np.abs(logprobs(chunked) - first_lp).max())
    np.testing.assert_allclose(logprobs(cached), first_lp, atol=LOGPROB_TOL)
    np.testing.assert_allclose(logprobs(chunked), first_lp, atol=LOGPROB_TOL)
    assert plain_tokens(eng, kv_dtype) == first


def test_quantized_cache_is_what_attention_reads():
    """Negative control: corrupting the scales of the cached prefix changes the tokens, so
    attention reads the scales (a kernel ignoring them would not notice)."""
    eng = make_engine("int8")
    first = logprobs(eng.generate([PROMPTS[0]], GREEDY))
    cache = eng.runner.kv_cache
    eng.runner.kv_cache = KVCache(tuple(QuantizedPages(p.values, p.scales * 7.0) for p in cache.pages))
    again = logprobs(eng.generate([PROMPTS[0]], GREEDY))
    assert eng.stats()["prefix_cache_hits"] > 0
    print("max |dlogprob| with scales x7", np.abs(again - first).max())
    assert np.abs(again - first).max() > 10 * LOGPROB_TOL


SCRIPT = """
import json, sys
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
engine = Engine.from_config("tiny_random", overrides=json.loads(sys.argv[1]), progress=False)
out = engine.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, logprobs=1))
layer = engine.runner.kv_cache.pages[0]
print(json.dumps({"tokens": [c.token_ids for c in out],
                  "logprobs": [[e["logprob"] for e in c.logprobs] for c in out],
                  "values_spec": str(getattr(layer.values.sharding, "spec", "")), "scales_spec": str(getattr(layer.scales.sharding, "spec", "")),
                  "scale_shard": list(layer.scales.addressable_shards[0].data.shape),
                  "scale_global": list(layer.scales.shape)}))
"""


def run_sharded(overrides, devices):
    env = dict(os.environ, XLA_FLAGS=fake_devices(devices))
    # the sharded runs compare with each other: the reference impl's faster compile
    # (tests/fast_engine.py)
    over = {**BASE, **REFERENCE_ATTENTION, **overrides}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(over), json.dumps(PROMPTS)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_device():
    return run_sharded({"engine.kv_cache_dtype": "int8"}, 1)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,devices", [({"mesh.tensor": 2}, 2), ({"mesh.data": 2}, 2),
                                          ({"mesh.tensor": 2, "mesh.sequence": 2}, 4)],
                         ids=["t2", "d2", "t2s2"])
def test_sharded_quantized_engine_equals_one_device(one_device, mesh, devices):
    r = run_sharded({"engine.kv_cache_dtype": "int8", **mesh}, devices)
    assert r["tokens"] == one_device["tokens"]
    np.testing.assert_allclose(r["logprobs"], one_device["logprobs"], atol=LOGPROB_TOL)
    # Scales are split exactly like the pages' first three axes.
    assert r["values_spec"].startswith(r["scales_spec"].rstrip(")"))
    if "mesh.tensor" in mesh:
        assert r["scale_shard"][2] * 2 == r["scale_global"][2]
    if "mesh.data" in mesh:
        assert r["scale_shard"][0] * 2 == r["scale_global"][0]
