"""Pipeline parallelism (mesh.stage): the same tokens as one device through Engine.generate
(chunked prefill, prefix caching, decode, sampling), each device holding only its stage's
layers and pages, and the pieces of models/parallel/pipeline.py on their own. Fake CPU devices in
subprocesses: the device count is fixed when the backend starts."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.config import load_config
from jaxfill.models.checkpoint import StackedSlices
from jaxfill.models.config import ConfigError
from jaxfill.models.forward import forward
from jaxfill.models.kv_cache import KVCache, single_sequence_metadata
from jaxfill.models.decoder import Decoder
from jaxfill.models.parallel.pipeline import microbatch_count, microbatch_metadata
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 48,
        "engine.max_model_len": 256}
SCRIPT = """
import json, sys
import jax
import numpy as np
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
shared = "The same long opening every request shares, long enough to fill whole pages. "
prompts = [shared + "first", "abc" * 40, shared + "second one", "Hi"]
params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3),
          SamplingParams(max_tokens=5, logprobs=2), SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=9)]
def subjaxprs(eqn):
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else [v]):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                yield sub

def dots(jaxpr, in_cond, acc):
    for eqn in jaxpr.eqns:
        acc[in_cond] += eqn.primitive.name == "dot_general"
        for sub in subjaxprs(eqn):
            dots(sub, in_cond or eqn.primitive.name == "cond", acc)
    return acc

def has(jaxpr, name):
    return any(e.primitive.name == name or any(has(s, name) for s in subjaxprs(e)) for e in jaxpr.eqns)

def tick_dots(jaxpr):  # [outside a cond, inside one] in the loop that ppermutes
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn):
            if eqn.primitive.name in ("while", "scan") and has(sub, "ppermute"):
                return dots(sub, False, [0, 0])
            found = tick_dots(sub)
            if found:
                return found
    return None

results = []
for overrides in json.loads(sys.argv[1]):
    engine = Engine.from_config(sys.argv[2], overrides=overrides, progress=False)
    out = engine.generate(prompts, params)
    again = engine.generate([shared + "third"], SamplingParams(max_tokens=6))  # prefix-cache hit
    r = {"tokens": [c.token_ids for c in out + again], "logprob": out[2].logprobs[0]["logprob"],
         "cached": again[0].cached_tokens, "free": engine.stats()["pages_free"],
         "total": engine.stats()["pages_total"]}
    mesh = engine.runner.mesh
    if mesh is not None and "stage" in mesh.axis_names and mesh.shape["stage"] > 1:
        grid = np.moveaxis(mesh.devices, mesh.axis_names.index("stage"), 0)
        stage_of = {d.id: i for i, row in enumerate(grid) for d in row.flat}
        # every stage-split array: each device's shard is the row of its own stage only
        rows = []
        for leaf in jax.tree.leaves(engine.runner.state["layers"]) + engine.runner.kv_cache.arrays():
            rows += [(stage_of[s.device.id], s.index[0].start, s.index[0].stop, s.data.shape[0])
                     for s in leaf.addressable_shards]
        runner = engine.runner  # no step may gather the embedding / LM head whole onto a device
        batch = runner.put(runner.dummy(runner.shapes[-1]))
        with runner.mesh_context():
            hlo = runner.step_fn.lower(runner.static_graph, runner.state, runner.kv_cache, batch,
                                     runner.prev_tokens).compile().as_text()
        vocab, hidden = engine.config.model.vocab_size, engine.config.model.hidden_size
        r["head_gathers"] = [line for line in hlo.splitlines() if "all-gather" in line
                             and (f"[{hidden},{vocab}]" in line or f"[{vocab},{hidden}]" in line)]
        with runner.mesh_context():  # where the tick loop's matmuls are: all inside its cond
            jaxpr = jax.make_jaxpr(runner.step_fn, static_argnums=0)(runner.static_graph, runner.state, runner.kv_cache,
                                                                   batch, runner.prev_tokens)
        r["tick_dots"] = tick_dots(jaxpr.jaxpr)
        emb = engine.runner.state["embed"]["embedding"][...]
        r.update(stage_rows=rows, mesh=dict(mesh.shape), embed_rows=emb.addressable_shards[0].data.shape[0],
                 vocab=emb.shape[0], layer_modules=len(engine.runner.state["layers"]),
                 cache_entries=len(engine.runner.kv_cache.pages))
    results.append(r)
print(json.dumps(results))
"""


def run(configs, devices, preset="tiny_random"):
    env = dict(os.environ, XLA_FLAGS=fake_devices(devices))
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([{**BASE, **c} for c in configs]), preset],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single():
    (r,) = run([{}], 1)
    assert r["cached"] > 0  # the prefix cache really served the last prompt
    assert len({tuple(t) for t in r["tokens"]}) == 5
    return r


def _check_same(r, single):
    assert r["tokens"] == single["tokens"]
    assert abs(r["logprob"] - single["logprob"]) < 1e-4
    assert r["cached"] == single["cached"]
    assert r["free"] == r["total"]  # every page came back


def _check_stage_local(r, stages, tensor=1):
    assert r["mesh"]["stage"] == stages
    assert r["layer_modules"] == r["cache_entries"] == 4 // stages  # tiny_random has 4 layers
    # each device's shard of every layer param and cache entry is exactly its stage's row
    assert r["stage_rows"] and all((s, s + 1, 1) == (start, stop, n) for s, start, stop, n in r["stage_rows"])
    assert r["embed_rows"] * stages * tensor == r["vocab"]  # embedding split over stage x tensor
    assert r["head_gathers"] == []  # logits stay vocab-split: the head is never gathered
    outside, inside = r["tick_dots"]  # fill/drain ticks skip the layers: every matmul sits in the cond
    assert outside == 0 and inside > 0, r["tick_dots"]


@pytest.mark.slow  # 58 s in a full run (2026-12-07, 2 loaded cores)
def test_two_stages_equal_one_device(single):
    (r,) = run([{"mesh.stage": 2}], 2)
    _check_same(r, single)
    _check_stage_local(r, 2)


@pytest.mark.slow
def test_four_devices_four_stages_and_stage_with_tensor_and_data(single):
    four, with_tensor, with_data = run([{"mesh.stage": 4}, {"mesh.stage": 2, "mesh.tensor": 2},
                                        {"mesh.stage": 2, "mesh.data": 2}], 4)
    for r in (four, with_tensor, with_data):
        _check_same(r, single)
    _check_stage_local(four, 4)
    _check_stage_local(with_tensor, 2, tensor=2)
    _check_stage_local(with_data, 2)


@pytest.mark.slow
def test_microbatch_counts_and_scanned_layers_do_not_change_tokens(single):
    # 1: no overlap; 3: not a divisor of the buckets, cut to 2; 16: one token per microbatch
    # in the 16-token decode bucket. Last: engine.scan_layers under tensor parallelism.
    configs = [{"mesh.stage": 2, "mesh.microbatches": m} for m in (1, 3, 16)]
    for r in run(configs + [{"engine.scan_layers": True, "mesh.tensor": 2}], 2):
        _check_same(r, single)


@pytest.mark.slow
def test_a_checkpoint_loads_straight_into_its_stages():
    """The trained tiny checkpoint (HF safetensors): each stage's devices read only their
    layers (StackedSlices), int8 weights quantized per layer as unstaged loading does."""
    single, single_int8 = run([{}, {"model.weight_dtype": "int8"}], 1, preset="tiny")
    staged, staged_int8 = run([{"mesh.stage": 2}, {"mesh.stage": 2, "model.weight_dtype": "int8"}], 2,
                              preset="tiny")
    _check_same(staged, single)
    _check_same(staged_int8, single_int8)
    _check_stage_local(staged, 2)


def test_stacked_slices_read_only_the_rows_asked_for():
    reads = []

    class Part:
        shape = (3, 2)

        def __init__(self, i):
            self.i = i

        def read(self, index=()):
            reads.append((self.i, tuple(index)))
            return np.full(self.shape, float(self.i))[tuple(index)]

    stacked = StackedSlices([Part(i) for i in range(4)])
    assert stacked.shape == (4, 3, 2)
    box = stacked.read((slice(2, 3), slice(1, 3), slice(0, 2)))
    assert box.shape == (1, 2, 2) and np.all(box == 2.0)
    assert [i for i, _ in reads] == [2]  # only layer 2 was read
    assert np.array_equal(stacked.read()[:, 0, 0], np.arange(4.0))


def test_staged_model_without_a_mesh_equals_the_plain_model():
    """The pipelined layout run stage after stage on one device: same logits and cache."""
    config = load_config("tiny_random").model
    plain, staged = Decoder(config), Decoder(config, plan=ExecutionPlan.stacked(2, 4))
    ids = np.arange(3, 33, dtype=np.int32)
    meta = single_sequence_metadata(30, 0, [1, 2], 16, pad_to=32)
    tokens, positions = jnp.asarray(np.pad(ids, (0, 2))), jnp.arange(32, dtype=jnp.int32)
    want, want_cache = forward(*nnx.split(plain), tokens, positions,
                               KVCache.create(config, 4, 16, fill_value=float("nan")), meta)
    got, got_cache = forward(*nnx.split(staged), tokens, positions,
                             KVCache.create(config, 4, 16, fill_value=float("nan"), stages=2), meta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # the same K/V rows up to float rounding: XLA may fuse a staged layer's projections
    # differently (jaxlib 0.10 without fusion emitters: 2.4e-7 apart); a row written to the
    # wrong page or layer is off by O(1), and NaN (the fill) where nothing was written
    for layer in range(config.num_layers):  # layer s*K + j is entry j, row s
        j, s = layer % 2, layer // 2
        np.testing.assert_allclose(np.asarray(got_cache.pages[j][s][1:3]), np.asarray(want_cache.pages[layer][1:3]),
                                   rtol=0, atol=1e-6)
    # regrouping a built model gives the same layout as building it staged
    regrouped = nnx.split(plain.staged(ExecutionPlan.stacked(2, 4)))[1]
    for a, b in zip(jax.tree.leaves(regrouped), jax.tree.leaves(nnx.split(staged)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_microbatch_metadata_cuts_queries_keys_and_slots():
    # two sequences: 3 cached + 5 new, then 0 cached + 3 new; 8 rows, microbatches of 4
    cu, kv_lens = jnp.asarray([0, 5, 8], jnp.int32), jnp.asarray([8, 3], jnp.int32)
    slots = jnp.arange(100, 108, dtype=jnp.int32)
    meta = single_sequence_metadata(1, 0, [1], 16)
    meta = type(meta)(cu_q_lens=cu, kv_lens=kv_lens, page_indices=jnp.zeros((2, 1), jnp.int32),
                      num_seqs=jnp.asarray([2], jnp.int32), slot_mapping=slots,
                      logits_indices=jnp.asarray([4, 7], jnp.int32))
    first = microbatch_metadata(meta, jnp.int32(0), 4, jnp.bool_(True))
    assert first.cu_q_lens.tolist() == [0, 4, 4] and first.kv_lens.tolist() == [7, 0]  # seq 2 starts after the rows
    assert first.slot_mapping.tolist() == [100, 101, 102, 103]
    second = microbatch_metadata(meta, jnp.int32(4), 4, jnp.bool_(True))
    assert second.cu_q_lens.tolist() == [0, 1, 4] and second.kv_lens.tolist() == [8, 3]
    assert second.slot_mapping.tolist() == [104, 105, 106, 107]
    idle = microbatch_metadata(meta, jnp.int32(4), 4, jnp.bool_(False))
    assert idle.cu_q_lens.tolist() == [0, 0, 0] and idle.slot_mapping.tolist() == [-1] * 4
    assert [microbatch_count(t, 4) for t in (16, 6, 3, 1)] == [4, 3, 3, 1]


def test_stage_must_divide_the_layers_and_excludes_sequence():
    with pytest.raises(ConfigError, match="must divide the model's 4 layers"):
        load_config("tiny_random", {"mesh.stage": 3})
    with pytest.raises(ConfigError, match="mesh.sequence"):
        load_config("tiny_random", {"mesh.stage": 2, "mesh.sequence": 2})
