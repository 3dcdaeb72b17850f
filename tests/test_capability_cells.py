"""A sample of the capability matrix's cells of every family, on its random-init HF
checkpoint (tests/hf_models.py): the kinds the family declares are what its checkpoint
holds; every refused cell refuses at load_config (config.json only, no weight read) in
one line naming its key; and an accepted one-device cell (quantized KV, prefix caching,
int8 weights or the host tier, in turn over the families) runs a step through the Engine
with every page back. About 3-5 s a family on 2 cores (checkpoint, config checks, one small
engine compiling one bucket): over a minute for the file because it is twenty families."""

from __future__ import annotations

import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.capabilities.table import CAPABILITIES, family_kinds, model_kinds
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.capabilities.support_matrix import family_support
from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry
from fast_engine import REFERENCE_ATTENTION

FAMILIES = list(dict.fromkeys(f.name for f in registry.families()))  # gemma3, qwen3_5: two classes each
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.num_pages": 24, "engine.max_model_len": 64, "engine.max_num_batched_tokens": 32,
        "engine.token_buckets": [32], "engine.max_num_seqs": 2, "mesh.cpu_split": False}
ONE_DEVICE = ("engine.kv_cache_dtype=int8", "engine.enable_prefix_caching", "model.weight_dtype=int8",
              "engine.kv_cache_dtype=float8_e4m3fn", "engine.host_kv_cache_gb")
DEVICE_KEYS = {"mesh.num_processes": {"mesh.coordinator": "127.0.0.1:1"}}
# families whose dense and MoE checkpoints share one architecture: the MoE one holds every kind declared
CHECKPOINT = {"gemma4": "gemma4_moe"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cells")
    return lambda name: make_hf_checkpoint(str(root / name), name)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_cells(checkpoints, name):
    family = next(f for f in registry.families() if f.name == name)
    directory = checkpoints(CHECKPOINT.get(name, name))
    cells = family_support(family)
    assert model_kinds(load_config("tiny", BASE, directory).model) == family_kinds(family)
    for col, cell in cells.items():
        if cell.status != "refused":
            continue
        sample = {**CAPABILITIES[col].sample, **DEVICE_KEYS.get(col, {})}
        with pytest.raises(ConfigError) as e:
            load_config("tiny", {**BASE, **sample}, directory)
        assert "\n" not in str(e.value) and col.split("=")[0] in str(e.value), (col, str(e.value))
    accepted = [c for c in ONE_DEVICE if cells[c].status != "refused"]
    col = accepted[FAMILIES.index(name) % len(accepted)]
    engine = Engine.from_config("tiny", model_path=directory, overrides={**BASE, **CAPABILITIES[col].sample},
                                progress=False)
    prompt = [(7 * i + 3) % 200 + 3 for i in range(20)]
    done = engine.generate([prompt, prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [3, 3], col
    st = engine.stats()
    assert st["pages_free"] == st["pages_total"] and engine.num_steps > 0, col
