"""GGUF files whose projections are all quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K; tests/test_gguf_kquant.py: llama.cpp's own k-quant mixes) stay packed on the device
(models/gguf/int_codes.py -> model.weight_dtype = int_group, the default for them): the
codes, scales and zero points give ggml's own values (tests/test_gguf.py proves those
against the reference dequantizer and transformers), the packed model's logits and greedy
tokens equal the dequantized load's, a file of mixed types loads dequantized and refuses
int_group by name."""

import os

import numpy as np
import pytest
from flax import nnx

from gguf_files import gguf, random_blocks, write_gguf
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
@pytest.mark.parametrize("form", [None, (8, 16, True), (8, 16, False)], ids=["own", "bytes16_zeros", "bytes16_sym"])
@pytest.mark.parametrize("kind", sorted(int_codes.FORMS))
def test_codes_scales_and_zeros_give_ggml_values(kind, form):
    """Each type in its own form and lifted into bytes in groups of 16 (a projection whose
    layers mix it with Q6_K), against gguf's reference dequantizer: exact where the zero
    point is an integer, an f32 rounding or two of the group's size where it is -m / d or
    dmin * mn / (d * sc). Blocks of scale 0 (one value everywhere, whatever their codes)
    are among them."""
    rng = np.random.default_rng(1)
    rows, n_in = 6, 512
    data = random_blocks(rng, kind, rows, n_in)
    nbytes = quants.TYPES[quants.NAMES[kind]][2]
    blocks = data.reshape(-1, nbytes)
    if kind in ("Q4_1", "Q5_1"):  # minimums of the scales' size, some blocks of scale 0 with mixed codes
        blocks[:, 2:4] = (-0.08 * rng.random((len(blocks), 1))).astype(np.float16).view(np.uint8)
        blocks[::5, 0:2] = 0
    if kind in ("Q4_K", "Q5_K"):  # a sub-block of 6-bit scale 0 (its minimum kept) in every block
        blocks[:, 4] &= 0xC0
    if kind == "Q6_K":
        blocks[::3, 192] = 0
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])  # [rows, in]
    fits = form is None or not int_codes.FORMS[kind][2] or form[2]
    if not fits:  # a type with zero points into a symmetric form: refused, never approximated
        with pytest.raises(ValueError, match="without zero points"):
            int_codes.codes(kind, data, n_in, form)
        return
    q, s, z = int_codes.codes(kind, data, n_in, form)  # [rows, in]; [in / group, rows] twice
    group = (form or int_codes.FORMS[kind])[1]
    assert q.dtype == np.uint8 and s.shape == z.shape == (n_in // group, rows)
    g = np.arange(n_in) // group
    got = (q.astype(np.float32) - z[g].T) * s[g].T
    exact = not int_codes.FORMS[kind][2]
    np.testing.assert_allclose(got, want, rtol=0, atol=0 if exact else 2e-7 * np.abs(want).max())
    assert np.isfinite(want).all() and (exact or kind == "Q6_K" or np.any(want[0, :32] == want[0, 0]))


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
    assert int_codes.quantization_config(__import__("jaxfill.models.gguf", fromlist=["header"]).header(path).tensors) \
        is None  # BF16 / F16 projections beside the quantized ones
    assert load_config("tiny", model_path=files["mixed"]).model.weight_dtype == "auto"
    with pytest.raises(ConfigError, match="Q4_K, Q5_K or Q6_K") as e:
        load_config("tiny", {"model.weight_dtype": "int_group"}, model_path=files["mixed"])
    assert "\n" not in str(e.value)
    # the packed file read dequantized on request: ggml's values, no codes kept
    config = load_config("tiny", {"model.weight_dtype": "auto"}, model_path=files["Q4_0"]).model
    model = load_hf_params(files["Q4_0"], config, progress=False)
    assert not any(np.asarray(v).dtype == np.uint8 for v in jax_leaves(model))


def jax_leaves(model):
    return [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
