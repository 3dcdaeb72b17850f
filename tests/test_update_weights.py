"""Engine.update_weights: another checkpoint's weights give that checkpoint's tokens.

Two random-init HF llama checkpoints (seeds 0 and 1, the same shapes). One engine built
from A is updated to B (a checkpoint directory, a params tree, (name, array) pairs) and
must generate what a fresh engine built from B generates, with no step program compiled,
the prefix cache emptied (a cached prompt is recomputed) and the old buffers deleted. A
refused source (an unknown name, a wrong shape or dtype) changes nothing.
"""

import numpy as np
import pytest

from fast_engine import REFERENCE_ATTENTION
from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.engine.weights_update import WeightUpdateError

OVER = {**REFERENCE_ATTENTION, "engine.max_model_len": 256, "engine.num_pages": 64, "engine.max_num_seqs": 4,
        "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32]}
PROMPTS = [list(range(5, 38)), [7, 8, 9, 10]]  # 33 tokens: two full pages are cached
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("update_weights")
    return {s: make_hf_checkpoint(str(root / f"seed{s}"), "llama", seed=s) for s in (0, 1)}


def build(path) -> Engine:
    return Engine(load_config("tiny_random", OVER, path), progress=False)


def tokens(engine) -> list:
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def ref(ckpts):
    """Each checkpoint's tokens from a fresh engine."""
    return {s: tokens(build(p)) for s, p in ckpts.items()}


@pytest.fixture(scope="module")
def eng(ckpts):
    return build(ckpts[0])


@pytest.fixture
def on_a(eng, ckpts, ref):
    """The module engine on checkpoint A's weights, whatever the test before left."""
    if tokens(eng) != ref[0]:
        eng.update_weights(ckpts[0])
    return eng


def test_checkpoints_differ(ref):
    assert ref[0] != ref[1]  # else nothing below could fail


def test_checkpoint_update_gives_its_tokens_without_a_compile(on_a, ckpts, ref):
    eng = on_a
    programs = eng.stats()["compiled_programs"]
    tokens(eng)  # cached now
    assert [c.cached_tokens for c in eng.generate(PROMPTS, GREEDY)][0] > 0
    old = [leaf for leaf in __import__("jax").tree.leaves(eng.runner.state)]
    out = eng.update_weights(ckpts[1])
    assert out["params_replaced"] == len(old) and out["freed_bytes"] == eng.runner.weight_bytes
    assert all(a.is_deleted() for a in old)  # the old buffers went
    got = eng.generate(PROMPTS, GREEDY)
    assert [c.cached_tokens for c in got] == [0, 0]  # its cached pages held A's K/V: recomputed
    assert [c.token_ids for c in got] == ref[1]
    assert eng.stats()["compiled_programs"] == programs
    eng.update_weights(ckpts[0])
    assert tokens(eng) == ref[0]
    assert eng.stats()["compiled_programs"] == programs


def test_params_tree_update(on_a, ckpts, ref):
    other = build(ckpts[1])
    on_a.update_weights(other.runner.state)
    assert tokens(on_a) == ref[1]
    assert tokens(other) == ref[1]  # its arrays, now shared, are not the ones deleted


def test_name_array_pairs_update(on_a, ckpts, ref):
    from safetensors.numpy import load_file

    tensors = load_file(f"{ckpts[1]}/model.safetensors")
    out = on_a.update_weights(iter(tensors.items()))
    assert out["params_replaced"] == len(tensors)
    assert tokens(on_a) == ref[1]


def test_partial_pairs_replace_only_what_they_name(on_a, ckpts, ref):
    from safetensors.numpy import load_file

    a, b = load_file(f"{ckpts[0]}/model.safetensors"), load_file(f"{ckpts[1]}/model.safetensors")
    on_a.update_weights([(n, b[n]) for n in b if ".layers.1." in n])
    assert tokens(on_a) not in (ref[0], ref[1])
    on_a.update_weights([(n, a[n]) for n in a if ".layers.1." in n])
    assert tokens(on_a) == ref[0]


@pytest.mark.parametrize("bad, error", [
    (lambda t: [("model.layers.0.mlp.bogus.weight", t["model.norm.weight"])], "model.layers.0.mlp.bogus.weight: not a"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"]),
                ("model.layers.1.self_attn.q_proj.weight", t["model.layers.1.self_attn.q_proj.weight"][:, :8])],
     r"model.layers.1.self_attn.q_proj.weight: shape \(64, 8\)"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"].astype(np.int32))], "model.norm.weight: dtype int32"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"])] * 2, "model.norm.weight: given twice"),
])
def test_bad_pairs_are_refused_and_change_nothing(on_a, ckpts, ref, bad, error):
    from safetensors.numpy import load_file

    programs = on_a.stats()["compiled_programs"]
    tensors = load_file(f"{ckpts[1]}/model.safetensors")
    with pytest.raises(WeightUpdateError, match=error):
        on_a.update_weights(bad(tensors))
    assert tokens(on_a) == ref[0]
    assert on_a.stats()["compiled_programs"] == programs


def test_bad_tree_and_checkpoint_are_refused(on_a, ckpts, ref, tmp_path):
    from flax import nnx
    from hf_models import make_hf_checkpoint

    tree = nnx.to_pure_dict(on_a.runner.state)
    del tree["layers"][1]["mlp"]
    with pytest.raises(WeightUpdateError, match="layers.1.mlp.* missing from the params tree"):
        on_a.update_weights(tree)
    tree = nnx.to_pure_dict(on_a.runner.state)
    tree["norm"]["weight"] = np.zeros((3,), np.float32)
    with pytest.raises(WeightUpdateError, match=r"norm.weight: shape \(3,\)"):
        on_a.update_weights(tree)
    wide = make_hf_checkpoint(str(tmp_path / "wide"), "llama", seed=1, intermediate_size=192)
    with pytest.raises(WeightUpdateError, match="mlp.*shape"):
        on_a.update_weights(wide)
    with pytest.raises(WeightUpdateError, match="path: .* is not a checkpoint directory"):
        on_a.update_weights(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="in_flight"):
        on_a.update_weights(ckpts[1], in_flight="later")
    assert tokens(on_a) == ref[0]


def _start(eng) -> list:
    """Two requests past their prefill, a few tokens decoded."""
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    outs = []
    while not all(r in eng.requests and eng.requests[r].output_ids for r in ids):
        outs += eng.step()
    return ids, outs


def _drain(eng, ids, outs) -> dict:
    while eng.has_unfinished():
        outs += eng.step()
    return {o.request_id: o.completion for o in outs if o.finished and o.request_id in ids}


def test_in_flight_finish_on_the_old_weights(on_a, ckpts, ref):
    ids, outs = _start(on_a)
    on_a.update_weights(ckpts[1], in_flight="finish")
    done = _drain(on_a, ids, outs)
    assert [done[r].token_ids for r in ids] == ref[0]
    assert [done[r].finish_reason for r in ids] == ["length", "length"]
    assert tokens(on_a) == ref[1]


def test_in_flight_abort(on_a, ckpts, ref):
    ids, outs = _start(on_a)
    on_a.update_weights(ckpts[1], in_flight="abort")
    done = _drain(on_a, ids, outs)
    assert [done[r].finish_reason for r in ids] == ["abort", "abort"]
    assert all(len(done[r].token_ids) < GREEDY.max_tokens for r in ids)
    assert on_a.stats()["pages_free"] == on_a.stats()["pages_total"]
    assert tokens(on_a) == ref[1]
