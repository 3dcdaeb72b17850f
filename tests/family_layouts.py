"""The check of tests/test_family_layouts*.py: every family through the Engine in every
layout gives the same tokens: unchunked == chunked == prefix-cached == mesh.tensor=2 ==
mesh.sequence=2 == engine.scan_layers == mesh.stage=2 (greedy, from the HF checkpoint of
tests/hf_models.py); int8 weights and int8 KV run and stay close. Prompts are longer
than the sliding windows (24) and cross Gemma 3's full layers. One subprocess per family
on 2 fake CPU devices (the device count is fixed at backend start); each builds 8
engines, so a case takes 40-100 s (compiles dominate), and the families are split over
two test files so the two workers of the suite share them."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
import numpy as np
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
model_dir, layouts = sys.argv[1], json.loads(sys.argv[2])
base = {"engine.max_num_batched_tokens": 512, "engine.token_buckets": [64, 512], "engine.num_pages": 96,
        "engine.max_model_len": 512, "mesh.cpu_split": False}
rng = np.random.default_rng(5)
long = [int(t) for t in rng.integers(3, 500, 300)]
prompts = [long, long[:200] + [int(t) for t in rng.integers(3, 500, 40)], [7, 9, 11]]
out = {}
for name, overrides in layouts.items():
    engine = Engine.from_config("tiny", model_path=model_dir, overrides={**base, **overrides}, progress=False)
    first = engine.generate([prompts[0]], SamplingParams(max_tokens=6, logprobs=1))
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=6, logprobs=1))
    st = engine.stats()
    done = first + rest
    out[name] = {"tokens": [c.token_ids for c in done], "cached": [c.cached_tokens for c in done],
                 "logprob": [c.logprobs[0]["logprob"] for c in done],
                 "pages_back": st["pages_free"] == st["pages_total"],
                 # MoE: pairs per expert per layer, and the token rows the forwards ran
                 "experts": {str(k): v.tolist() for k, v in engine.expert_tokens(refresh=True).items()},
                 "rows": sum(len(p) - c.cached_tokens + len(c.token_ids) - 1 for p, c in zip(prompts, done)),
                 "top_k": engine.config.model.experts_per_token,
                 "last_layer": engine.config.model.num_layers - 1}
print("RESULT " + json.dumps(out))
"""
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    "chunked": {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": 64,
                "engine.token_buckets": [16, 64]},
    "prefix": {},
    "tensor2": {"mesh.tensor": 2},
    "sequence2": {"mesh.sequence": 2},
    "scan": {"engine.scan_layers": True},
    "stage2": {"mesh.stage": 2},
    "int8": {"model.weight_dtype": "int8", "engine.kv_cache_dtype": "int8"},
}
EXACT = ("chunked", "prefix", "tensor2", "sequence2", "scan", "stage2")


def check_every_layout(model_dir: str, arch: str, layouts: dict = LAYOUTS, exact: tuple = EXACT,
                       devices: int = 2) -> None:
    """`layouts` (name: overrides, "whole" the reference) in one subprocess on `devices`
    fake CPU devices: the `exact` ones give the reference's tokens and logprobs."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model_dir, json.dumps(layouts)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
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
        assert r["prefix"]["cached"][1] >= 192  # the shared 200 tokens' pages
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
