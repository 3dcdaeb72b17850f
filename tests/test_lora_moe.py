"""LoRA on a mixture of experts (Qwen3-MoE: two sparse layers around a dense one): PEFT's
target_parameters on the fused experts (gate_up_proj, down_proj) served per routed pair
beside attention and dense-MLP adapters, against transformers + PEFT in f32."""

import numpy as np
import pytest

from lora_adapters import Reference, make_family
from test_lora import ENGINE, LORA, TOKENS, prompt
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base, dirs = make_family(str(tmp_path_factory.mktemp("lora")), "qwen3_moe", ("E", "F"))
    engine = Engine.from_config(model_path=base, overrides={**ENGINE, **LORA}, progress=False)
    for name, path in dirs.items():
        engine.load_lora(name, path)
    return engine, Reference(base, dirs)


@pytest.mark.slow
def test_expert_adapters_equal_transformers_peft(moe):
    engine, ref = moe
    long, short = prompt(100, 1), prompt(9, 2)
    asks = [(long, "E"), (short, None), (short, "F"), (short, "E")]
    outs = engine.generate([ids for ids, _ in asks],
                           [SamplingParams(max_tokens=TOKENS, lora=name, logprobs=5) for _, name in asks])
    for (ids, name), out in zip(asks, outs):
        assert out.token_ids == ref.greedy(name, ids, TOKENS), name
        want = ref.last_logprobs(name, ids)
        top = out.logprobs[0]["top"]
        np.testing.assert_allclose([lp for _, lp in top], want[[i for i, _ in top]], atol=2e-4, rtol=1e-4)
    assert len({tuple(o.token_ids) for o in outs[1:]}) == 3  # each adapter changes the short prompt's tokens
