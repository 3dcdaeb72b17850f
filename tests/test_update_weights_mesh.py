"""update_weights and sleep/wake on a mesh (mesh.tensor = 2 over two fake CPU devices):
the new params are placed with the old ones' NamedShardings, give a fresh engine's
tokens, and nothing compiles. Runs in one subprocess (this file as a script), since the
pytest process has one CPU device."""

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVER = {"engine.attention_impl": "reference", "engine.max_model_len": 256, "engine.num_pages": 64,
        "engine.max_num_seqs": 4, "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32],
        "mesh.tensor": 2}
PROMPTS = [list(range(5, 38)), [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("update_mesh")
    paths = [make_hf_checkpoint(str(root / f"seed{s}"), "llama", seed=s) for s in (0, 1)]
    env = dict(os.environ, XLA_FLAGS=fake_devices(2), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.dirname(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *paths], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.slow
def test_mesh_update_gives_a_fresh_engines_tokens(results):
    r = results
    assert r["devices"] == 2 and r["sharded_params"] > 0
    assert r["a"] != r["b"]
    assert r["after_checkpoint"] == r["b"] and r["after_pairs"] == r["a"]
    assert r["shardings_kept"] and r["programs_after"] == r["programs_before"]


@pytest.mark.slow
def test_mesh_sleep_level_2_and_wake(results):
    r = results
    assert r["asleep_bytes"] < 1024  # the step's last tokens only
    assert r["freed"] == r["device_bytes"] - r["asleep_bytes"] and r["live_drop"] == r["freed"]
    assert r["after_wake"] == r["a"] and r["shardings_kept_after_wake"]


def _worker(path_a: str, path_b: str) -> None:
    import jax
    from safetensors.numpy import load_file

    from jaxfill import Engine, SamplingParams
    from jaxfill.engine.config import load_config

    greedy = SamplingParams(max_tokens=8, ignore_eos=True)

    def tokens(e):
        return [c.token_ids for c in e.generate(PROMPTS, greedy)]

    def shardings(e):
        return [a.sharding for a in jax.tree.leaves(e.runner.state)]

    b = Engine(load_config("tiny_random", OVER, path_b), progress=False)
    out = {"b": tokens(b), "devices": len(jax.devices())}
    del b
    e = Engine(load_config("tiny_random", OVER, path_a), progress=False)
    out["a"] = tokens(e)
    before = shardings(e)
    out["sharded_params"] = sum(not s.is_fully_replicated for s in before)
    out["programs_before"] = e.stats()["compiled_programs"]
    e.update_weights(path_b)
    out["after_checkpoint"] = tokens(e)
    e.update_weights(load_file(os.path.join(path_a, "model.safetensors")).items())
    out["after_pairs"] = tokens(e)
    out["shardings_kept"] = shardings(e) == before
    def live():  # bytes of every live array on this process's devices
        return sum({(s.device, s.data.unsafe_buffer_pointer()): s.data.nbytes  # aliases once
                    for a in jax.live_arrays() if not a.is_deleted() for s in a.addressable_shards}.values())

    dev, live_before = e.stats()["device_bytes"], live()
    out["freed"] = e.sleep(2)["freed_bytes"]
    out["asleep_bytes"] = e.stats()["device_bytes"]
    out["device_bytes"] = dev
    out["live_drop"] = live_before - live()
    e.wake()
    out["after_wake"] = tokens(e)
    out["shardings_kept_after_wake"] = shardings(e) == before
    out["programs_after"] = e.stats()["compiled_programs"]
    print("RESULTS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
