"""Step executables kept under a key computed without tracing (engine/executable_cache.py):
an engine built again with the same source, config and shapes loads every step program
from disk and never traces the step; a changed config misses (a one-device program in a two-device process: loaded back onto its device); a damaged entry compiles
again; the tokens are the same every time. One subprocess builds the four engines one
after another (the pytest process keeps jax's persistent cache off: tests/conftest.py);
a new engine's programs come only from disk, as after a restart."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os, sys
import jax
from jaxfill import Engine, SamplingParams
from jaxfill.engine import executable_cache

traced = []  # the step functions jax traced in this process (its own monitoring events)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: traced.append(kw.get("fun_name")) if event.endswith("jaxpr_trace_duration") else None)
BASE = {"engine.num_pages": 64, "engine.max_num_seqs": 4, "engine.max_num_batched_tokens": 32,
        "engine.async_scheduling": False}


def start(**overrides):
    jax.clear_caches()  # as a new process: nothing traced or compiled in memory
    before = traced.count("step")
    engine = Engine.from_config("tiny_random", overrides={**BASE, **overrides}, progress=False,
                                compile_cache=sys.argv[1])
    out = engine.generate([[5, 9, 2, 7, 11, 3], [4, 4, 8, 1, 12, 6, 2, 9, 10]],
                          SamplingParams(max_tokens=6, temperature=0.0))
    programs = engine.core.runner.programs
    counts = {"hits": programs.hits, "misses": programs.misses, "kept": len(programs)} if executable_cache.enabled() else {}
    return {"tokens": [c.token_ids for c in out], "traced": traced.count("step") - before, **counts}


ONE = {"mesh.cpu_split": False}  # a one-device program in a two-device process
report = {"cold": start(), "warm": start(), "changed": start(**ONE), "changed_warm": start(**ONE),
          "devices": len(jax.devices())}
directory = os.path.join(sys.argv[1], "jaxfill_executables")
report["files"] = len(os.listdir(directory))
for name in os.listdir(directory):
    with open(os.path.join(directory, name), "wb") as f:
        f.write(b"not a pickle")
report["damaged"] = start()
# jax's cache already holding the programs (as after an upgrade): they are used, not kept
# here (a program jax loaded from its cache loses its code when serialized again)
sys.argv[1] = os.path.join(sys.argv[1], "other")
executable_cache.enabled, on = (lambda: False), executable_cache.enabled
report["jax_only"] = start()
executable_cache.enabled = on
report["jax_hit"], report["jax_hit_again"] = start(), start()
report["jax_hit_files"] = len(os.listdir(os.path.join(sys.argv[1], "jaxfill_executables"))) if os.path.isdir(
    os.path.join(sys.argv[1], "jaxfill_executables")) else 0
print(json.dumps(report))
"""


def test_a_new_engine_loads_every_step_program_without_tracing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    cold, warm, changed, damaged = r["cold"], r["warm"], r["changed"], r["damaged"]
    assert cold["misses"] == cold["kept"] >= 2 and cold["hits"] == 0  # a prefill and a decode bucket at least
    assert cold["traced"] >= cold["misses"]  # each compiled program traced (the pool probe may trace too)

    assert warm["tokens"] == cold["tokens"]
    assert warm["hits"] == warm["kept"] == cold["kept"] and warm["misses"] == 0
    assert warm["traced"] == 0, "an engine built again traced the step"

    assert r["devices"] == 2
    assert changed["tokens"] == cold["tokens"]  # one device, not the CPU split's two: nothing to reuse
    assert changed["hits"] == 0 and changed["misses"] == changed["kept"] and changed["traced"] >= changed["misses"]
    # loaded onto the one device it was compiled for (jax's default would spread it over both)
    again = r["changed_warm"]
    assert again["tokens"] == cold["tokens"] and again["hits"] == again["kept"] and again["traced"] == 0
    assert r["files"] == cold["kept"] + changed["kept"]

    assert damaged["tokens"] == cold["tokens"]  # unreadable entries: compiled again (jax's cache has them)
    assert damaged["hits"] == 0 and damaged["misses"] == damaged["kept"]

    jax_hit, again = r["jax_hit"], r["jax_hit_again"]
    assert r["jax_only"]["tokens"] == jax_hit["tokens"] == again["tokens"] == cold["tokens"]
    assert jax_hit["misses"] == jax_hit["kept"] and again["misses"] == again["kept"]
    assert r["jax_hit_files"] == 0
