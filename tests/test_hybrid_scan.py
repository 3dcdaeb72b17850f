"""engine.scan_layers on linear-attention hybrids: one scan step is one period of the layer
pattern (Qwen3.5's [DeltaNet x3, attention]; a Nemotron-H pattern of Mamba2, MLP and
attention single-block layers), the state slots stacked like the pages [groups, slots, ...].
Model level (random-init HF checkpoints, f32, NaN-filled pages and slots): every chunk's
and every decode step's logits equal the unrolled model's within 1e-5, so the greedy tokens
do too; the state of a slot exports in layer order whatever the layout. A pattern with no
period shorter than the model is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.config import load_config
from jaxfill.engine.kv_rows import export_state, import_state
from jaxfill.engine.simple import prefill_chunks
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.execution_plan import ExecutionPlan, scan_period
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.kv_cache import KVCache

NAN = float("nan")
PAGE, SLOTS = 16, 3


def _models(tmp_path_factory, arch: str, **hf):
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_scan") / arch), arch, **hf)
    config = config_from_hf(directory)
    plan = ExecutionPlan.stacked(config.num_layers // scan_period(config), scan=True)
    return directory, config, load_hf_params(directory, config, progress=False), \
        load_hf_params(directory, config, progress=False, plan=plan)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):  # 8 layers: linear 0-2 and 4-6, attention 3 and 7
    return _models(tmp_path_factory, "qwen3_5", num_hidden_layers=8)


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):  # Mamba2, MLP-only, attention-only, twice
    return _models(tmp_path_factory, "nemotron_h", hybrid_override_pattern="M-*M-*", num_hidden_layers=6)


def cache(model, config) -> KVCache:
    return KVCache.create(config, num_pages=12, page_size=PAGE, fill_value=NAN, state_slots=SLOTS,
                          stages=model.stages)


def trace(model, config, prompt: list[int], chunk: int, new: int):
    """Each prefill chunk's and each greedy decode step's last logits [V], the tokens, the cache."""
    c, pages, seq, out, tokens = cache(model, config), list(range(1, 10)), list(prompt), [], []
    for end in range(chunk, len(prompt) + chunk, chunk):
        logits, c = prefill_chunks(model, prompt[:min(end, len(prompt))], c, pages, start=end - chunk)
        out.append(np.asarray(logits))
    for _ in range(new):
        tokens.append(int(np.argmax(out[-1])))
        seq.append(tokens[-1])
        logits, c = prefill_chunks(model, seq, c, pages, start=len(seq) - 1)
        out.append(np.asarray(logits))
    return out, tokens, c


def check_scan_equals_unrolled(models, groups: int):
    _, config, unrolled, scanned = models
    assert scanned.stages == groups and len(scanned.layers) == config.num_layers // groups
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config.vocab_size, 40)]
    want, want_tokens, want_cache = trace(unrolled, config, prompt, 16, 6)
    got, got_tokens, got_cache = trace(scanned, config, prompt, 16, 6)
    assert len(got) == 3 + 6 and np.isfinite(got).all()
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
    assert got_tokens == want_tokens
    # the state: stacked [groups, slots, ...], the same per layer as the unrolled cache's
    state = next(e for e in got_cache.pages if hasattr(e, "recurrent") or hasattr(e, "state"))
    state = getattr(state, "state", state)
    assert state.recurrent.shape[:2] == (groups, SLOTS)
    for a, b in zip(export_state(got_cache, 0), export_state(want_cache, 0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    return got_cache, want_cache


def test_qwen3_5_scans_one_period_per_step(qwen3_5):
    _, config, _, _ = qwen3_5
    assert config.linear.layers == (0, 1, 2, 4, 5, 6) and scan_period(config) == 4
    got_cache, want_cache = check_scan_equals_unrolled(qwen3_5, groups=2)
    # import writes the exported layer-order rows back into the stacked slots (slot 2, NaN before)
    moved = import_state(got_cache, export_state(want_cache, 0), 2)
    for a, b in zip(export_state(moved, 2), export_state(want_cache, 0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_mamba2_single_block_pattern_scans(nemotron_h):
    _, config, _, _ = nemotron_h
    assert config.linear.kind == "mamba2" and scan_period(config) == 3
    check_scan_equals_unrolled(nemotron_h, groups=2)


def test_falcon_h1_parallel_layers_scan_one_layer_per_step(tmp_path_factory):
    """Falcon-H1: attention and Mamba2 in every layer, so the period is one layer."""
    models = _models(tmp_path_factory, "falcon_h1")
    config = models[1]
    assert scan_period(config) == 1 and len(config.linear.layers) == config.num_layers
    check_scan_equals_unrolled(models, groups=config.num_layers)


@pytest.mark.parametrize("layers, linear", [(7, (0, 1, 2, 4, 5, 6)), (8, (0, 1, 2, 4, 5))],
                         ids=["count_not_a_multiple", "not_periodic"])
def test_a_pattern_with_no_period_is_refused(layers, linear):
    overrides = {"model.num_layers": layers, "model.linear_layers": list(linear), "engine.scan_layers": True}
    with pytest.raises(ConfigError, match=r"engine.scan_layers: the model's linear_layers .* do not repeat"):
        load_config("tiny_random", {**_HYBRID, **overrides})


def test_stages_whose_layer_kinds_differ_are_refused():
    """mesh.stage = 2 stacks layer j of each stage as one module: linear 0-2 and 4-5 of 8 do not."""
    overrides = {"model.num_layers": 8, "model.linear_layers": [0, 1, 2, 4, 5], "mesh.stage": 2}
    with pytest.raises(ConfigError, match=r"linear_layers \[0, 1, 2, 4, 5\] differ between the 2 stacked"):
        load_config("tiny_random", {**_HYBRID, **overrides})
    load_config("tiny_random", {**_HYBRID, **overrides, "model.linear_layers": [0, 1, 2, 4, 5, 6]})



def test_the_planner_puts_a_stage_s_state_on_its_devices():
    """Qwen3.5-9B on 2 stages: a device holds half the layers' state (as the stacked state's
    [1, slots, ...] shards in test_pipeline_stages_hold_their_layers_state)."""
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import plan_prefill

    hw = load_hardware("h100")
    one, two = (plan_prefill(load_config("qwen3_5_9b", {"mesh.stage": p}), hw, 256) for p in (1, 2))
    assert two["state_bytes_per_request"] == one["state_bytes_per_request"] > 0
    assert two["state_bytes_per_request_per_device"] * 2 == one["state_bytes_per_request_per_device"]


_HYBRID = {"model.linear_kind": "gated_deltanet", "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,
           "model.linear_key_head_dim": 8, "model.linear_value_head_dim": 8, "model.linear_conv_kernel": 4}


def test_a_periodic_config_scans_and_stacks_its_state():
    config = load_config("tiny_random", {**_HYBRID, "model.num_layers": 8, "model.linear_layers": [0, 2, 4, 6],
                                         "engine.scan_layers": True})
    plan = ExecutionPlan.of_config(config)
    assert (plan.layer_groups, plan.layout) == (4, "scan")
    c = jax.eval_shape(lambda: KVCache.create(config.model, 6, 8, stages=4, state_slots=2))
    assert c.pages[0].recurrent.shape == (4, 2, 4, 8, 8) and c.pages[1].shape[:2] == (4, 6)
    assert jnp.dtype(c.pages[0].recurrent.dtype) == jnp.float32


ENGINE = {"engine.attention_impl": "reference", "engine.max_num_batched_tokens": 32, "engine.token_buckets": [16, 32],
          "engine.num_pages": 48, "engine.max_model_len": 128, "engine.max_num_seqs": 2,
          "engine.kv_fill_value": NAN, "engine.state_snapshot_tokens": 16}


@pytest.mark.slow  # 18-25 s call + 6 s checkpoint (2026-12-07, 2 loaded cores)
def test_engine_scan_shares_steps_resumes_snapshots_and_frees_slots(qwen3_5):
    """Through the Engine: requests in shared steps, more than the slots, two in a wave
    resuming from a state snapshot (copy_state_slots on the stacked slots); greedy tokens
    equal the unrolled engine's and every page and slot comes back."""
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    directory, config = qwen3_5[:2]
    rng = np.random.default_rng(3)
    root = [int(t) for t in rng.integers(0, config.vocab_size, 36)]
    prompts = [root + [5, 6, 7], [int(t) for t in rng.integers(0, config.vocab_size, 21)], root[:33], [9]]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(scan: bool):
        e = Engine.from_config("tiny", model_path=directory, progress=False,
                               overrides={**ENGINE, "engine.scan_layers": scan})
        done = e.generate(prompts[:2], greedy) + e.generate(prompts[2:], greedy)
        out = [(c.token_ids, _numbers(c.logprobs)) for c in done]
        st, sch = e.stats(), e.scheduler.replicas[0]
        assert st["pages_free"] == st["pages_total"] and len(sch.free_slots) == e.config.engine.state_slots
        return out, st, e

    want, _, _ = run(False)
    got, st, e = run(True)
    assert e.runner.stages == 2 and [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):  # the top-2 logprobs of every token, as sharp as the tokens are not
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert st["state_snapshot_hits"] >= 1, st


def _numbers(x) -> list[float]:
    """Every number in a completion's logprobs entries, in order."""
    if isinstance(x, dict):
        return [v for k in sorted(x, key=str) for v in _numbers(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _numbers(item)]
    return [float(x)] if isinstance(x, (int, float)) else []


SNAPSHOTS = {"engine.state_snapshot_tokens": 32}
SCAN_LAYOUTS = {"whole": {"engine.enable_prefix_caching": False},
                "scan": {"engine.scan_layers": True, "engine.enable_prefix_caching": False},
                "scan_chunked": {"engine.scan_layers": True, "engine.enable_prefix_caching": False,
                                 "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]},
                "scan_prefix": {"engine.scan_layers": True, **SNAPSHOTS},
                "scan_tensor2": {"engine.scan_layers": True, "mesh.tensor": 2, **SNAPSHOTS},
                "scan_data2": {"engine.scan_layers": True, "mesh.data": 2, **SNAPSHOTS}}


@pytest.mark.slow  # 27 s call, 112 s at load 7 (2026-12-07, 2 cores)
def test_scan_layouts_agree_with_the_unrolled_engine(qwen3_5):
    """On 2 fake devices (tests/family_layouts.py): scanned whole, in 16-token chunks,
    resuming from snapshots, with each rank half the heads' state (mesh.tensor = 2) and
    with a slot pool per replica (mesh.data = 2): the unrolled engine's tokens and logprobs."""
    from family_layouts import check_layouts, run_layouts

    r = run_layouts(qwen3_5[0], SCAN_LAYOUTS, devices=2)
    check_layouts(r, "qwen3_5", exact=tuple(n for n in SCAN_LAYOUTS if n != "whole"))
    assert r["scan_prefix"]["cached"][1] >= 64 and r["scan_tensor2"]["cached"][1] >= 64
    (_, heads, *rest), _ = r["whole"]["state_shard"]  # [slots, Hv, Dk, Dv]
    assert r["scan"]["state_shard"][0][0] == 2 and r["scan"]["state_shard"][0][2:] == [heads, *rest]
    assert r["scan_tensor2"]["state_shard"][0][2:] == [heads // 2, *rest]  # [groups, slots, Hv / 2, ...]


STAGE_LAYOUTS = {"whole": {"engine.enable_prefix_caching": False},
                 "stage2": {"mesh.stage": 2, "engine.enable_prefix_caching": False},
                 "stage2_chunked": {"mesh.stage": 2, "engine.enable_prefix_caching": False,
                                    "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]},
                 "stage2_prefix": {"mesh.stage": 2, **SNAPSHOTS},
                 "stage2_tensor2": {"mesh.stage": 2, "mesh.tensor": 2, **SNAPSHOTS},
                 "stage2_data2": {"mesh.stage": 2, "mesh.data": 2, **SNAPSHOTS}}


@pytest.mark.slow  # 25 s call, 107 s at load 8 (2026-12-07, 2 cores)
def test_pipeline_stages_hold_their_layers_state(qwen3_5):
    """mesh.stage = 2 on 2 (and 4) fake devices: each stage holds its 4 layers' params, pages and
    state slots ([1, slots, ...] per device), the 128-row prefill pipelined in 4
    microbatches (a sequence's state handed from one microbatch to the next in its slot);
    whole, chunked, from snapshots, and with tensor = 2 or data = 2 beside the stages: the
    unrolled engine's tokens and logprobs."""
    from family_layouts import check_layouts, run_layouts

    two = {n: v for n, v in STAGE_LAYOUTS.items() if v.get("mesh.tensor", 1) * v.get("mesh.data", 1) == 1}
    r = run_layouts(qwen3_5[0], two, devices=2)  # the device count must equal the mesh's
    r.update(run_layouts(qwen3_5[0], {n: v for n, v in STAGE_LAYOUTS.items() if n not in two}, devices=4))
    check_layouts(r, "qwen3_5", exact=tuple(n for n in STAGE_LAYOUTS if n != "whole"))
    assert all(r[n]["cached"][1] >= 64 for n in ("stage2_prefix", "stage2_tensor2", "stage2_data2"))
    (_, heads, *rest), _ = r["whole"]["state_shard"]
    assert r["stage2"]["state_shard"][0][0] == 1 and r["stage2"]["state_shard"][0][2:] == [heads, *rest]
    assert r["stage2_tensor2"]["state_shard"][0][2:] == [heads // 2, *rest]


@pytest.mark.slow  # 12 s call in pytest, 32 s as a script with imports (2026-12-07, 2 loaded cores)
def test_scanned_snapshots_leave_for_the_host_tier_and_come_back(qwen3_5):
    """engine.scan_layers with the host KV tier (tests/test_hybrid_host_tier.py's rounds):
    stacked state snapshots exported in layer order, restored into fresh slots; the tokens
    of the unrolled engine without prefix caching."""
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    base = {"engine.attention_impl": "reference", "engine.page_size": 8, "engine.num_pages": 14,
            "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16], "engine.max_model_len": 64,
            "engine.max_num_seqs": 2, "engine.kv_fill_value": NAN, "engine.state_snapshot_tokens": 16,
            "engine.state_snapshot_slots": 2}
    rng = np.random.default_rng(5)
    docs = [[int(t) for t in rng.integers(1, 250, 32)] for _ in range(4)]
    prompts = [(docs[i] if (r + i) % 3 else docs[i][:19]) + [int(t) for t in rng.integers(1, 250, 5)]
               for r in range(3) for i in rng.permutation(4)]

    def run(**overrides):
        e = Engine.from_config("tiny", model_path=qwen3_5[0], overrides={**base, **overrides}, progress=False)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return [c.token_ids for k in range(0, len(prompts), 2) for c in e.generate(prompts[k:k + 2], greedy)], e

    want, _ = run(**{"engine.state_snapshot_tokens": 0})
    got, e = run(**{"engine.scan_layers": True, "engine.host_kv_cache_gb": 0.002})
    assert got == want and e.runner.stages == 2
    assert e.stats()["host_state_snapshots_restored"] >= 2, e.stats()


@pytest.mark.slow  # 29 s call + 15 s checkpoint (2026-12-07, 2 loaded cores)
def test_scanned_speculation_rolls_the_stacked_state_back(qwen3_5):
    """n-gram proposals on the scanned hybrid: a rejected verification restores the state
    copied before it into every group's rows of the request's slot; the tokens equal the
    unrolled engine's without speculation, with rejections replayed, and every slot comes back."""
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    base = {"engine.attention_impl": "reference", "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16],
            "engine.num_pages": 160, "engine.page_size": 8, "engine.max_model_len": 160, "engine.max_num_seqs": 3,
            "engine.kv_fill_value": NAN, "engine.state_snapshot_tokens": 16, "engine.state_snapshot_slots": 32}
    ngram = {"speculative.method": "ngram", "speculative.num_tokens": 3, "speculative.ngram_max": 3,
             "speculative.ngram_min": 1, "speculative.backoff_window": 0}
    rng = np.random.default_rng(5)
    pat, other = [int(t) for t in rng.integers(0, 512, 5)], [int(t) for t in rng.integers(0, 512, 4)]
    prompts = [pat * 7, pat * 4 + other * 2, pat * 4 + [pat[0]] * 3, other * 5]

    def run(**overrides):
        e = Engine.from_config("tiny", model_path=qwen3_5[0], overrides={**base, **overrides}, progress=False)
        out = [c.token_ids for c in e.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                                        ignore_eos=True))]
        st, sch = e.stats(), e.scheduler.replicas[0]
        assert st["pages_free"] == st["pages_total"] and len(sch.free_slots) == e.config.engine.state_slots
        return out, st

    want, _ = run()
    got, st = run(**{"engine.scan_layers": True, **ngram})
    assert got == want and st["spec_state_replays"] > 0, st
