"""LoRA under mesh.tensor = 2 (fake CPU devices in a subprocess: the device count is fixed at
backend start): the slot tables split with the base weights (models/lora.py: A whole and B
split for q/k/v/gate/up, A split and B whole for o/down), and a batch of base rows and two
adapters' rows gives the tokens transformers + PEFT give."""

import json
import os
import subprocess
import sys

import pytest

from lora_adapters import Reference, make_family
from test_lora import ENGINE, LORA, TOKENS, prompt
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
base, dirs, overrides, asks = (json.loads(a) for a in sys.argv[1:])
engine = Engine.from_config(model_path=base, overrides=overrides, progress=False)
for name, path in dirs.items():
    engine.load_lora(name, path)
outs = engine.generate([ids for ids, _ in asks], [SamplingParams(max_tokens=%d, lora=n) for _, n in asks])
leaves = engine.runner.state["layers"][0]
shard = lambda v: list(v[...].addressable_shards[0].data.shape)
print(json.dumps({"tokens": [o.token_ids for o in outs], "mesh": dict(engine.runner.mesh.shape),
                  "q_b": shard(leaves["attn"]["lora"]["q_b"]), "o_a": shard(leaves["attn"]["lora"]["o_a"]),
                  "down_a": shard(leaves["mlp"]["lora"]["down_a"]), "up_a": shard(leaves["mlp"]["lora"]["up_a"])}))
""" % TOKENS


@pytest.mark.slow
def test_tensor_parallel_lora_equals_the_reference(tmp_path):
    base, dirs = make_family(str(tmp_path), "llama", ("A", "B"))
    asks = [(prompt(100, 1), "A"), (prompt(7, 2), None), (prompt(30, 3), "B"), (prompt(7, 2), "A")]
    overrides = {**ENGINE, **LORA, "mesh.tensor": 2}
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(base), json.dumps(dirs), json.dumps(overrides),
                          json.dumps(asks)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mesh"]["tensor"] == 2
    # [L, R, heads, D] split on heads; o's A [L, heads, D, R] split on heads; down's A on its input
    assert r["q_b"] == [2, 8, 2, 16] and r["o_a"] == [2, 2, 16, 8] and r["down_a"] == [2, 80, 8]
    assert r["up_a"] == [2, 64, 8]  # whole on each device
    ref = Reference(base, dirs)
    assert r["tokens"] == [ref.greedy(name, ids, TOKENS) for ids, name in asks]
