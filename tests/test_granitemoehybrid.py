"""Granite 4.0-H (Mamba2 / attention layers, each with an MLP: a mixture of experts beside
the shared MLP, or the shared MLP alone) against Hugging Face transformers on random-init
checkpoints (tests/hf_models.py HYBRID_KWARGS: Granite's four multipliers far from 1), at the
model level (engine/simple.py): f32 last-row logits within 1e-5 relative and greedy tokens
equal to HF's generate, for the MoE checkpoint with rope and a dense one without (NoPE
attention first, 4 Mamba groups); each multiplier, the shared MLP and the rope move the
logits; a prefill in chunks (the state carried through its slot) equals it whole; a fresh
sequence ignores its slot; through the Engine, prompts sharing prefixes resume from state
snapshots, and every layout the capability table allows (chunked, prefix-cached, tensor 2)
gives the unchunked tokens. Unused pages and slots are NaN-filled throughout."""

import json
import os

import numpy as np
import pytest

from family_layouts import check_layouts, run_layouts
from hf_models import load_hf, make_hf_checkpoint
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.simple import generate_one
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf, param_count
from jaxfill.models.kv_cache import KVCache
from test_family_parity import check_feature_changes_the_logits
from test_hybrid_parity import check_chunked_equals_whole, check_fresh_sequence_ignores_its_slot, checkpoint
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2
from fast_engine import REFERENCE_ATTENTION

ARCH = "granitemoehybrid"
NAN = float("nan")
DENSE = dict(num_local_experts=0, position_embedding_type=None, mamba_n_groups=4,
             layer_types=["attention", "mamba", "mamba"])


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return checkpoint(tmp_path_factory, ARCH)


def check_matches_hf(directory, config, model) -> None:
    hf = load_hf(directory)
    assert param_count(config) == sum(p.numel() for p in hf.parameters())
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    check_greedy_matches_hf(model, config, hf, 16)


def test_f32_logits_and_greedy_tokens_match_hf(granite):
    directory, config, model = granite
    assert config.linear.layers == (0, 2) and config.linear.kind == "mamba2" and config.attention.nope_layers == ()
    assert (config.moe.num_experts, config.moe.shared_expert_size, config.moe.scoring) == (8, 48, "topk_softmax")
    assert (config.embeddings.scale, config.residual_scale, config.attention.query_scale,
            config.embeddings.logits_scale) == (3.0, 0.5, 0.3, 0.5)
    check_matches_hf(directory, config, model)


def test_dense_nope_checkpoint_matches_hf(tmp_path):
    """num_local_experts = 0: the shared MLP is the layer's only MLP; no rope
    (position_embedding_type None); B and C in 4 groups of 2 heads; attention first."""
    directory = make_hf_checkpoint(str(tmp_path / "dense"), ARCH, **DENSE)
    config = config_from_hf(directory)
    assert config.moe.num_experts == 0 and config.intermediate_size == 48 and config.attention.nope_layers == (0,)
    check_matches_hf(directory, config, load_hf_params(directory, config, progress=False))


@pytest.mark.parametrize("name, ablation", [
    ("embedding", dict(embed_scale=1.0)), ("residual", dict(residual_scale=1.0)),
    ("attention", dict(query_scale=None)), ("logits", dict(logits_scale=1.0)),
    ("shared-mlp", dict(shared_expert_size=0)), ("rope", dict(nope_layers=(1,))),
])
def test_each_feature_changes_the_logits(granite, name, ablation):
    check_feature_changes_the_logits(granite[0], ablation, name)


@pytest.mark.parametrize("chunk", [7, 16])  # one-token steps: the greedy decode above
def test_chunked_prefill_equals_whole(granite, chunk):
    check_chunked_equals_whole(granite[2], granite[1], chunk)


def test_a_fresh_sequence_ignores_what_its_slot_holds(granite):
    check_fresh_sequence_ignores_its_slot(granite[2], granite[1])


def test_what_it_cannot_reproduce_is_refused_by_name(granite):
    with open(os.path.join(granite[0], "config.json")) as f:
        hf = json.load(f)
    for change, name in [({"mamba_proj_bias": True}, "mamba_proj_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                         ({"layer_types": ["mamba"] * 3}, "no attention"), ({"layer_types": ["mamba", "moe", "mamba"]},
                                                                             "moe"),
                         ({"position_embedding_type": "alibi"}, "position_embedding_type"),
                         ({"mamba_d_head": 12}, "mamba_d_head")]:
        with pytest.raises(ConfigError, match=name):
            config_from_hf({**hf, **change})
    legacy = dict(hf, layer_types=["mamba", "attention", "mamba"])  # the published configs' spelling
    assert config_from_hf(legacy) == config_from_hf(hf)


# ------------------------------------------------------------------- through the engine
NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 128, "engine.max_num_seqs": 2, "engine.kv_fill_value": NAN,
        "engine.state_snapshot_tokens": 16}


@pytest.mark.slow  # 99 s in a full run (2026-12-07, 2 loaded cores)
def test_through_the_engine_with_state_snapshots(granite):
    """Prompts sharing a 32-token root (and one sharing 16 of it), in two waves so the
    second resumes from the first's snapshots in slots other requests used, equal the
    model-level loop alone on a fresh NaN-filled cache; every page and slot comes back."""
    directory, config, model = granite
    rng = np.random.default_rng(12)
    ids = lambda n: [int(t) for t in rng.integers(0, config.vocab_size, n)]  # noqa: E731
    root = ids(32)
    prompts_ = [root + ids(7), root + ids(18), root + ids(1), root[:16] + ids(12), ids(20)]
    want = [generate_one(model, p, KVCache.create(config, 8, 16, fill_value=NAN), NEW)[0] for p in prompts_]
    e = Engine.from_config("tiny", model_path=directory, overrides=BASE, progress=False)
    assert e.config.engine.enable_prefix_caching and e.config.engine.state_slots == 2
    got = [c.token_ids for c in e.generate(prompts_[:2], GREEDY) + e.generate(prompts_[2:], GREEDY)]
    assert got == want
    st = e.stats()
    assert st["state_snapshot_hits"] >= 2 and st["cached_tokens_total"] >= 2 * 16, st
    assert st["pages_free"] == st["pages_total"]
    assert len(e.scheduler.replicas[0].free_slots) == e.config.engine.state_slots


SNAPSHOTS = {"engine.state_snapshot_tokens": 32}
CHUNKED = {"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]}
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    "chunked": {"engine.enable_prefix_caching": False, **CHUNKED},
    "prefix": SNAPSHOTS,
    "tensor2": {"mesh.tensor": 2, **SNAPSHOTS},
    "tensor2_chunked": {"mesh.tensor": 2, **CHUNKED, **SNAPSHOTS},
}


@pytest.mark.slow  # 43 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_layouts_agree(tmp_path, variant):
    """Unchunked == 16-token chunks == prefix-cached through state snapshots == mesh.tensor
    = 2 (each rank half the Mamba2 groups' params and state, half of each expert and of the
    shared MLP) whole and chunked, through the Engine on 2 fake CPU devices."""
    directory = make_hf_checkpoint(str(tmp_path / variant), ARCH, **(DENSE if variant == "dense" else {}))
    r = run_layouts(directory, LAYOUTS, devices=2)
    check_layouts(r, ARCH, exact=tuple(n for n in LAYOUTS if n != "whole"))
    (_, heads, *rest), (_, channels, k) = r["whole"]["state_shard"]
    for name in LAYOUTS:
        split = 2 if name.startswith("tensor2") else 1
        got = [shape[1:] for shape in r[name]["state_shard"]]
        assert got == [[heads // split, *rest], [channels // split, k]], (name, got)
