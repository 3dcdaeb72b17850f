"""A CPU host's default: one XLA CPU device per core and the heads split over them
(engine/cpu_devices.py), with the tokens of one device. Each case runs in a child
process with a controlled environment and CPU affinity, since jax fixes the CPU device
count when its backends start (and this process is pinned to one by conftest.py)."""

import json
import os
import subprocess
import sys

import pytest

from fast_engine import REFERENCE_ATTENTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, logging, os, sys
args = json.loads(sys.argv[1])
os.sched_setaffinity(0, args["cores"])  # before jax starts: the cores this process may use
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(f"{r.levelname} {r.getMessage()}")
logging.getLogger("jaxfill.cpu").addHandler(handler)
logging.getLogger("jaxfill.cpu").setLevel(logging.INFO)
import jax
import jaxfill
if args.get("use_cpu_cores"):
    jaxfill.use_cpu_cores()  # the notebook recipe: right after `import jax`
if args.get("jax_first"):
    jax.numpy.zeros(2).block_until_ready()  # a notebook cell that used jax before the Engine
from jaxfill import Engine, SamplingParams
try:
    engine = Engine.from_config("tiny_random", overrides=args["overrides"], progress=False)
except ValueError as e:
    print(json.dumps({"error": str(e), "devices": len(jax.devices())}))
    sys.exit(0)
params = [SamplingParams(max_tokens=6, logprobs=2), SamplingParams(max_tokens=6, logprobs=2)]
out = engine.generate(["Hello there", "The quick brown fox" * 3], params)
mesh = engine.runner.mesh
print(json.dumps({"devices": len(jax.devices()), "mesh": dict(mesh.shape) if mesh is not None else None,
                  "config_tensor": engine.config.mesh.tensor, "tokens": [c.token_ids for c in out],
                  "logprobs": [[lp["logprob"] for lp in c.logprobs] for c in out], "log": records}))
"""
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.num_pages": 32, "engine.max_model_len": 128, "engine.max_num_batched_tokens": 64,
        "engine.token_buckets": [64], "engine.max_num_seqs": 2, "engine.seq_buckets": [2]}
SPLIT_LINE = "INFO CPU: heads split over 2 XLA CPU devices, one per core (mesh.tensor=2); set mesh.cpu_split=false for one device"

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores in the affinity mask")


def run(overrides=None, cores=(0, 1), xla_flags=None, **flags) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    args = {"overrides": {**BASE, **(overrides or {})}, "cores": list(cores), **flags}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_device():
    r = run({"mesh.cpu_split": False})
    assert r["devices"] == 1 and r["mesh"] is None and r["config_tensor"] == 1
    assert not r["log"]  # cpu_split=false: no devices added, nothing to suggest
    assert len({tuple(t) for t in r["tokens"]}) == 2
    return r


def same_outputs(r, ref) -> None:
    assert r["tokens"] == ref["tokens"]
    for got, want in zip(r["logprobs"], ref["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
@needs_two_cores
def test_default_splits_heads_over_two_cores(one_device):
    r = run()
    assert r["devices"] == 2
    assert r["mesh"] == {"stage": 1, "data": 1, "tensor": 2, "expert": 1, "sequence": 1} and r["config_tensor"] == 2
    assert r["log"] == [SPLIT_LINE]
    same_outputs(r, one_device)


@needs_two_cores
def test_a_bf16_model_is_not_split():
    """XLA:CPU aborts compiling bf16 all-reduces (AllReducePromotion), so the default split
    leaves a bf16 model on one device instead of killing the process."""
    r = run({"model.dtype": "bfloat16"})
    assert r["devices"] == 2 and r["mesh"] is None and r["config_tensor"] == 1
    assert len(r["log"]) == 1 and "aborts compiling a bf16 model's all-reduces" in r["log"][0]
    assert all(len(t) == 6 for t in r["tokens"])


def test_one_core_gets_one_device(one_device):
    r = run(cores=(0,))
    assert r["devices"] == 1 and r["mesh"] is None and not r["log"]
    same_outputs(r, one_device)


@pytest.mark.slow
@needs_two_cores
@pytest.mark.parametrize("count", [1, 4])
def test_xla_flags_device_count_wins(one_device, count):
    r = run(xla_flags=f"--xla_force_host_platform_device_count={count}")
    assert r["devices"] == count
    if count == 1:
        assert r["mesh"] is None and not r["log"]  # the user's choice: no hint either
    else:  # tiny_random: 4 heads, 2 KV heads (repeated), intermediate 344: all split over 4
        assert r["mesh"]["tensor"] == 4 and r["config_tensor"] == 4
        assert "heads split over 4 of 4 XLA CPU devices (2 cores)" in r["log"][0]
    same_outputs(r, one_device)


@needs_two_cores
def test_explicit_mesh_that_does_not_match_still_errors():
    r = run({"mesh.tensor": 4})  # 2 cores -> 2 CPU devices; an explicit mesh is never trimmed
    assert r["devices"] == 2
    assert "tensor=4" in r["error"] and "but 2 cpu device(s)" in r["error"]


@pytest.mark.slow  # 38 s in a full run (2026-12-07, 2 loaded cores)
@needs_two_cores
def test_jax_started_first_gets_one_device_and_the_hint(one_device):
    r = run(jax_first=True)
    assert r["devices"] == 1 and r["mesh"] is None
    assert len(r["log"]) == 1 and r["log"][0].startswith("WARNING") and "jaxfill.use_cpu_cores()" in r["log"][0]
    same_outputs(r, one_device)


@needs_two_cores
def test_use_cpu_cores_before_jax_starts_gives_the_split():
    r = run(use_cpu_cores=True, jax_first=True)
    assert r["devices"] == 2 and r["mesh"]["tensor"] == 2
    assert r["log"] == [SPLIT_LINE]


def test_importing_jaxfill_starts_no_backend():
    code = ("import jaxfill, jaxfill.engine.engine, jaxfill.serving.cli\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("overrides,devices,want", [
    ({}, 3, 2),  # 4 heads: 3 devices -> 2
    ({}, 8, 4),  # never more than the heads
    ({"model.intermediate_size": 342}, 4, 2),  # 342 % 4 != 0: the planner's check says 2
    ({"model.num_heads": 3, "model.num_kv_heads": 3, "model.intermediate_size": 345}, 2, 1),  # no split
])
def test_split_tensor_uses_the_planners_mesh_check(overrides, devices, want):
    from jaxfill.engine.config import load_config
    from jaxfill.engine.cpu_devices import split_tensor

    config = load_config("tiny_random", overrides)
    assert split_tensor(config.model, config.mesh, devices) == want
