"""The check of tests/test_family_layouts*.py: every family through the Engine in every
layout gives the same tokens: unchunked == chunked == prefix-cached == mesh.tensor=2 ==
mesh.sequence=2 == engine.scan_layers == mesh.stage=2 (greedy, from the HF checkpoint of
tests/hf_models.py); int8 weights and int8 KV run and stay close. Prompts are longer
than the sliding windows (24) and cross Gemma 3's full layers. One subprocess per family
on 2 fake CPU devices (the device count is fixed at backend start); each builds 8
engines. XLA:CPU compiles dominate, so each engine compiles one step bucket (chunked:
one smaller one), and the prompts (100, 84 and 3 tokens) let that bucket be 128 tokens:
a 512-token step program compiles ~1.5-2x slower than a 128-token one. The families
are split over two test files so the two workers of the suite share them.

The engines serve with the `reference` attention impl unless a caller asks for another:
these checks compare layouts with each other, not attention numerics (the HF parity
tests run every family through `xla`, tests/test_attention_oracle.py every impl against
float64), and the reference's step program compiles ~4x faster than xla's blocked loops
(tiny_random: 3.1 -> 0.8 s). tests/test_family_layouts.py runs Qwen3 through `auto` (xla)
under every mesh axis too."""

import json
import os
import subprocess
import sys

import numpy as np
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
import numpy as np
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.models.linear_state import cache_states
model_dir, layouts, impl = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
# one bucket: the whole 100-token prompt, then the 84 + 3 of the second call, in one step each
base = {"engine.max_num_batched_tokens": 128, "engine.token_buckets": [128], "engine.num_pages": 48,
        "engine.max_model_len": 128, "engine.max_num_seqs": 4, "mesh.cpu_split": False,
        "engine.attention_impl": impl}
rng = np.random.default_rng(5)
long = [int(t) for t in rng.integers(3, 500, 100)]
prompts = [long, long[:72] + [int(t) for t in rng.integers(3, 500, 12)], [7, 9, 11]]
out = {}
for name, overrides in layouts.items():
    engine = Engine.from_config("tiny", model_path=model_dir, overrides={**base, **overrides}, progress=False)
    # a hybrid's first linear layer as a fresh cache allocates it (warm-up steps return the
    # engine's own cache in the step's output shardings): each state array's shape on one device
    state_shard = [list(a.addressable_shards[0].data.shape) for e in cache_states(engine.runner.new_cache(2).pages)
                   for a in (e.recurrent, e.conv)][:2]
    first = engine.generate([prompts[0]], SamplingParams(max_tokens=6, logprobs=1))
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=6, logprobs=1))
    st = engine.stats()
    done = first + rest
    out[name] = {"tokens": [c.token_ids for c in done], "cached": [c.cached_tokens for c in done],
                 "logprob": [c.logprobs[0]["logprob"] for c in done],
                 "pages_back": st["pages_free"] == st["pages_total"],
                 "kv_bytes_per_token": st["kv_bytes_per_token"],
                 # MoE: pairs per expert per layer, and the token rows the forwards ran
                 "experts": {str(k): v.tolist() for k, v in engine.expert_tokens(refresh=True).items()},
                 "rows": sum(len(p) - c.cached_tokens + len(c.token_ids) - 1 for p, c in zip(prompts, done)),
                 "top_k": engine.config.model.moe.experts_per_token,
                 "last_layer": engine.config.model.num_layers - 1, "state_shard": state_shard}
print("RESULT " + json.dumps(out))
"""
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    # 16-token chunks, shorter than the window: a chunk's window reaches into two earlier ones
    "chunked": {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": 16,
                "engine.token_buckets": [16]},
    "prefix": {},
    "tensor2": {"mesh.tensor": 2},
    "sequence2": {"mesh.sequence": 2},
    "scan": {"engine.scan_layers": True},
    "stage2": {"mesh.stage": 2},
    "int8": {"model.weight_dtype": "int8", "engine.kv_cache_dtype": "int8"},
}
EXACT = ("chunked", "prefix", "tensor2", "sequence2", "scan", "stage2")


def check_every_layout(model_dir: str, arch: str, layouts: dict = LAYOUTS, exact: tuple = EXACT,
                       devices: int = 2, impl: str = "reference") -> None:
    """`layouts` (name: overrides, "whole" the reference) in one subprocess on `devices`
    fake CPU devices: the `exact` ones give the reference's tokens and logprobs."""
    check_layouts(run_layouts(model_dir, layouts, devices, impl), arch, exact)


def run_layouts(model_dir: str, layouts: dict, devices: int, impl: str = "reference") -> dict:
    """Runs `layouts` in one subprocess on `devices` fake CPU devices with attention impl
    `impl`: {name: result}."""
    env = dict(os.environ, XLA_FLAGS=fake_devices(devices))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model_dir, json.dumps(layouts), impl], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def check_layouts(r: dict, arch: str, exact: tuple) -> None:
    """The checks on run_layouts' results (r["whole"] the reference; it may come from
    another run of the same model, on another device count: it runs on one device)."""
    want = r["whole"]
    assert len({tuple(t) for t in want["tokens"]}) == 3
    for name in exact:
        assert r[name]["tokens"] == want["tokens"], (arch, name)
        np.testing.assert_allclose(r[name]["logprob"], want["logprob"], atol=2e-4, err_msg=f"{arch} {name}")
    for name in r:
        assert r[name]["pages_back"], (arch, name)
    assert want["cached"] == [0, 0, 0]
    if want["experts"]:
        check_expert_counts(r, exact)
    if "prefix" in r:
        assert r["prefix"]["cached"][1] >= 64  # the shared 72 tokens' full pages (16 tokens each)
    if "int8" not in r:
        return
    # int8 weights and KV: the first token's logprob moves by what quantization moves it
    # (tests/test_weight_quant.py measures 1-3% on the logits of these random models)
    assert np.max(np.abs(np.subtract(r["int8"]["logprob"], want["logprob"]))) < 0.25, (arch, r["int8"])


def check_expert_counts(r: dict, exact: tuple) -> None:
    """MoE: every layer but the last (which may run the sampled rows only) routed top_k
    pairs for each token row the forwards ran, warm-up padding never counted; layouts
    that ran the same rows (not prefix-cached) routed each expert the same pairs."""
    want = r["whole"]
    for name, got in r.items():
        assert set(got["experts"]) == set(want["experts"]), name
        for layer, counts in got["experts"].items():
            if int(layer) != got["last_layer"]:
                assert sum(counts) == got["top_k"] * got["rows"], (name, layer, sum(counts), got["rows"])
        if name in exact and got["rows"] == want["rows"]:
            for layer, counts in got["experts"].items():
                if int(layer) != got["last_layer"]:
                    assert counts == want["experts"][layer], (name, layer)
