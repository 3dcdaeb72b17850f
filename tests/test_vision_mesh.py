"""Images under mesh.tensor = 2 (fake CPU devices in a subprocess: the device count is fixed
at backend start). The vision tower runs replicated and the text model splits as Qwen3's; a
batch of a one-image prompt and a two-image prompt, in 64-token steps (a chunk boundary
inside an image), gives the one-device engine's greedy tokens and top-20 logprobs. Both
engines run in the same subprocess, so the reference costs no second backend start."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_flags import fake_devices

from test_vision_engine import BIG, WIDE, one_image, two_images
from vision_models import N_NEW, TOP, tiny_qwen3_vl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
import numpy as np
from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import SamplingParams
ckpt, asks, n_new, top = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pixels = np.load(sys.argv[5])
prompts = [{"prompt": ids, "images": [pixels[name] for name in names]} for ids, names in asks]
out = {}
for tensor in (1, 2):
    over = {"engine.max_model_len": 512, "engine.num_pages": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
            "engine.attention_impl": "reference", "mesh.tensor": tensor, "mesh.cpu_split": False}
    eng = Engine(load_config("tiny_random", over, ckpt), progress=False)
    res = eng.generate(prompts, SamplingParams(max_tokens=n_new, ignore_eos=True, logprobs=top))
    embed = eng.runner.state["embed"]["embedding"][...]
    out[tensor] = {"tokens": [c.token_ids for c in res], "prompt_tokens": [c.prompt_tokens for c in res],
                   "top": [[s["top"] for s in c.logprobs] for c in res], "mesh": dict(eng.runner.mesh.shape) if eng.runner.mesh else None,
                   "encoder_misses": eng.stats()["encoder_cache_misses"],
                   "embed_rows": embed.addressable_shards[0].data.shape[0]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_images_under_tensor_parallelism_equal_one_device(tmp_path):
    """Slow (26 s on the shared 2-core host: one subprocess compiling two engines)."""
    ckpt = tiny_qwen3_vl(str(tmp_path / "qwen3_vl"))
    asks = [(one_image(), ["big"]), (two_images(), ["big", "wide"])]
    images = str(tmp_path / "images.npz")
    np.savez(images, big=BIG, wide=WIDE)
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    res = subprocess.run([sys.executable, "-c", SCRIPT, ckpt, json.dumps(asks), str(N_NEW), str(TOP), images],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    one, split = out["1"], out["2"]
    assert split["mesh"]["tensor"] == 2 and one["mesh"] is None  # no mesh: one device
    assert split["embed_rows"] * 2 == one["embed_rows"] == 512  # the vocab is split, not replicated
    assert split["prompt_tokens"] == one["prompt_tokens"] == [len(one_image()) - 1 + 64, 105]
    assert split["encoder_misses"] == one["encoder_misses"] == 2  # BIG once (shared), WIDE once
    assert split["tokens"] == one["tokens"]
    for ours, ref in zip(split["top"], one["top"]):
        for a, b in zip(ours, ref):
            assert [i for i, _ in a] == [i for i, _ in b]
            np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-4)
