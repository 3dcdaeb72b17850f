"""GGUF files whose projections are all Q4_0, Q4_1 or Q8_0 stay packed on the device
(models/gguf/int_codes.py -> model.weight_dtype = int_group, the default for them): the
codes, scales and zero points give ggml's own values (tests/test_gguf.py proves those
against the reference dequantizer and transformers), the packed model's logits and greedy
tokens equal the dequantized load's, a file of mixed types loads dequantized and refuses
int_group by name."""

import os

import numpy as np
import pytest
from flax import nnx

from gguf_files import random_blocks, write_gguf
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.gguf import int_codes, quants
from test_model_parity import ours_last_logits, prompts, rel_l2

KINDS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_codes_scales_and_zeros_give_ggml_values(kind):
    rng = np.random.default_rng(1)
    rows, n_in = 6, 256
    data = random_blocks(rng, kind, rows, n_in)
    if kind == "Q4_1":  # minimums of the scales' size; blocks of scale 0 (llama.cpp writes codes 0 there)
        blocks = data.reshape(-1, 20)
        blocks[:, 2:4] = (-0.08 * rng.random((len(blocks), 1))).astype(np.float16).view(np.uint8)
        blocks[::5, 0:2] = 0
        blocks[::5, 4:] = 0
    want = quants.dequantize_rows(data, quants.NAMES[kind], n_in)  # [rows, in]
    q, s, z = int_codes.codes(kind, data, n_in)  # [rows, in]; [in / 32, rows] twice
    assert q.dtype == np.uint8 and s.shape == z.shape == (n_in // 32, rows)
    group = np.arange(n_in) // 32
    got = (q.astype(np.float32) - z[group].T) * s[group].T
    # Q4_0 / Q8_0: exact; Q4_1's float zero point -m/d: an f32 rounding or two of the block's size
    np.testing.assert_allclose(got, want, rtol=0, atol=0 if kind != "Q4_1" else 2e-7 * np.abs(want).max())
    assert np.isfinite(want).all() and (kind != "Q4_1" or np.any(want[0, :32] == want[0, 0]))
    if kind == "Q4_1":
        mixed = data.copy().reshape(-1, 20)
        mixed[0, 0:2], mixed[0, 4] = 0, 0x21  # scale 0 beside two different codes: no (s, z) gives it
        with pytest.raises(ValueError, match="scale 0"):
            int_codes.codes(kind, mixed.reshape(rows, -1), n_in)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_int")
    out = {kind: str(root / kind) for kind in KINDS if write_gguf(str(root / kind), "llama", projections=kind)}
    out["qwen2_Q4_1"] = str(root / "qwen2_Q4_1")
    write_gguf(out["qwen2_Q4_1"], "qwen2", projections="Q4_1")
    out["mixed"] = str(root / "mixed")
    write_gguf(out["mixed"], "llama")  # tests/gguf_files.py TYPES: k-quants beside Q4_0 / Q4_1 / Q8_0
    return out


@pytest.mark.parametrize("name", [*KINDS, "qwen2_Q4_1"])
def test_packed_model_equals_the_dequantized_load(files, name):
    """Llama's q/k rows come permuted from llama.cpp (each device's box of a packed param
    must follow the same row order); Qwen2 adds q/k/v biases."""
    packed_config = config_from_hf(files[name]).replace(dtype="float32")
    assert packed_config.weight_dtype == "int_group"
    assert packed_config.weight_bits == (8 if name == "Q8_0" else 4) and packed_config.weight_group_size == 32
    packed = load_hf_params(files[name], packed_config, progress=False)
    plain = load_hf_params(files[name], packed_config.replace(weight_dtype="auto"), progress=False)
    q_proj = packed.layers[0].attn.q[...]
    assert q_proj.dtype == np.uint8 and q_proj.nbytes < plain.layers[0].attn.q[...].nbytes / (3 if name != "Q8_0"
                                                                                               else 1.5)
    for length, tokens in prompts(packed_config.vocab_size):
        err = rel_l2(ours_last_logits(packed, packed_config, tokens),
                     ours_last_logits(plain, packed_config.replace(weight_dtype="auto"), tokens))
        assert err <= 1e-5, (name, length, err)
    del packed, plain


def test_engine_greedy_tokens_packed_equal_dequantized(files):
    base = {"engine.num_pages": 24, "engine.max_model_len": 96, "engine.max_num_batched_tokens": 64,
            "engine.token_buckets": [64], "engine.max_num_seqs": 2, "mesh.cpu_split": False, "model.dtype": "float32"}
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, 40)]
    out = {}
    for dtype in ("int_group", "auto"):
        engine = Engine.from_config("tiny", model_path=files["Q4_1"], overrides={**base, "model.weight_dtype": dtype},
                                    progress=False)
        assert engine.config.model.weight_dtype == dtype
        done = engine.generate([prompt, prompt[:17]], SamplingParams(max_tokens=8, ignore_eos=True))
        out[dtype] = [c.token_ids for c in done]
        st = engine.stats()
        assert st["pages_free"] == st["pages_total"]
    assert out["int_group"] == out["auto"]


def test_mixed_types_load_dequantized_and_refuse_int_group(files):
    path = os.path.join(files["mixed"], "model.gguf")
    assert int_codes.packed_type(__import__("jaxfill.models.gguf", fromlist=["header"]).header(path).tensors) is None
    assert load_config("tiny", model_path=files["mixed"]).model.weight_dtype == "auto"
    with pytest.raises(ConfigError, match="Q4_0, Q4_1 or Q8_0") as e:
        load_config("tiny", {"model.weight_dtype": "int_group"}, model_path=files["mixed"])
    assert "\n" not in str(e.value)
    # the packed file read dequantized on request: ggml's values, no codes kept
    config = load_config("tiny", {"model.weight_dtype": "auto"}, model_path=files["Q4_0"]).model
    model = load_hf_params(files["Q4_0"], config, progress=False)
    assert not any(np.asarray(v).dtype == np.uint8 for v in jax_leaves(model))


def jax_leaves(model):
    return [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
