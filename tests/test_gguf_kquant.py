"""GGUF k-quant mixes as llama.cpp writes them, kept packed per projection.

tests/gguf_llama_cpp/ holds three tiny random models quantized by llama.cpp's own
`llama_model_quantize` (tests/llama_cpp_quantize.py): a Llama in Q4_K_M (attn_v and
ffn_down Q6_K on layer 1, Q4_K elsewhere, output Q6_K), a Qwen2 in Q4_K_M whose 320-wide
rows are no whole super-block (llama.cpp's Q5_0 / Q8_0 fallbacks beside Q4_K / Q6_K), a
Qwen3 in Q5_K_M. Each projection keeps the form that holds its layers' types
(models/gguf/int_codes.py); the reference is transformers' `from_pretrained(gguf_file=)`,
which dequantizes everything to f32."""

import os

import numpy as np
import pytest
from flax import nnx

from family_layouts import LAYOUTS, check_layouts, run_layouts
from gguf_files import gguf  # noqa: F401  (skips without the gguf package)
from jaxfill.engine.config import load_config
from jaxfill.engine.planner.counts import weight_bytes
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.config.int_quantization import int_fields
from jaxfill.models.families.registry import config_from_hf
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_llama_cpp")
FILES = {name: os.path.join(HERE, f"{name}.gguf") for name in ("llama_Q4_K_M", "qwen2_Q4_K_M", "qwen3_Q5_K_M")}
# (bits, group, zero points) of the model and the projections kept otherwise
FORMS = {"llama_Q4_K_M": ((4, 32, True), "v:8:16:1,down:8:16:1"),
         "qwen2_Q4_K_M": ((8, 32, False), "down:8:16:1"),
         "qwen3_Q5_K_M": ((8, 32, True), "v:8:16:1,down:8:16:1")}


def hf_model(path: str):
    torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                   dtype=torch.float32, attn_implementation="eager").eval()


def uint8_bytes(model) -> tuple[int, int]:
    """(bytes of the uint8 code params, bytes of every param)."""
    leaves = [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
    return sum(a.nbytes for a in leaves if a.dtype == np.uint8), sum(a.nbytes for a in leaves)


@pytest.mark.parametrize("name", sorted(FILES))
def test_llama_cpp_mix_packed_equals_transformers_and_our_dequantized_run(name):
    """Per-projection forms from the file's types; the codes stay uint8 on the device
    (4-bit: two a byte); f32 last-row logits within 1e-5 of transformers' GGUF load and of
    our dequantized load, greedy tokens equal transformers'."""
    config = config_from_hf(FILES[name]).replace(dtype="float32")
    (bits, group, zero), others = FORMS[name]
    assert (config.weight_dtype, config.weight_bits, config.weight_group_size, config.weight_zero_point,
            config.weight_int_forms) == ("int_group", bits, group, zero, others)
    model = load_hf_params(FILES[name], config, progress=False)
    attn, mlp, h = model.layers[1].attn, model.layers[1].mlp, config.hidden_size
    q_bytes = h * config.num_heads * config.head_dim * bits // 8
    assert attn.q[...].dtype == np.uint8 and attn.q[...].nbytes == q_bytes
    assert mlp.down[...].dtype == np.uint8 and mlp.down[...].nbytes == h * config.intermediate_size  # a byte a code
    assert mlp.down_scale.scale[...].shape == (config.intermediate_size // 16, h)  # Q6_K's 16-value groups
    assert attn.q_scale.scale[...].dtype == np.float32 and (attn.q_scale.zero is not None) == zero
    plain = load_hf_params(FILES[name], config.replace(weight_dtype="auto"), progress=False)
    codes, total = uint8_bytes(model)
    assert codes > 0 and total < 0.6 * uint8_bytes(plain)[1]
    assert weight_bytes(config) == total  # the planner's count (and so Engine.stats' plan) is what is held
    ours = {length: ours_last_logits(model, config, tokens) for length, tokens in prompts(config.vocab_size)[:3]}
    for length, tokens in prompts(config.vocab_size)[:3]:
        assert rel_l2(ours[length], ours_last_logits(plain, config.replace(weight_dtype="auto"), tokens)) <= 1e-5
    hf = hf_model(FILES[name])  # the torch-free leg stops here
    for length, tokens in prompts(config.vocab_size)[:3]:
        assert rel_l2(ours[length], hf_last_logits(hf, tokens)) <= 1e-5, (name, length)
    check_greedy_matches_hf(model, config, hf, 12)


def test_llama_q4_k_m_tensor2_and_scan_equal_one_device():
    """Layer 1's v and down hold Q6_K blocks, layer 0's Q4_K lifted into the same form, so
    the layers stack (scan) and split over mesh.tensor = 2 with whole groups a device."""
    layouts = {name: {**LAYOUTS[name], "model.dtype": "float32"} for name in ("whole", "tensor2", "scan")}
    check_layouts(run_layouts(HERE + "/llama_Q4_K_M.gguf", layouts, devices=2), "llama", ("tensor2", "scan"))


def test_malformed_gguf_quantization_is_refused_in_one_line():
    bad = [({"quant_method": "gguf", "ggml_types": {"q": "Q3_K"}}, "ggml_types.q"),
           ({"quant_method": "gguf", "ggml_types": {"lm_head": "Q4_K"}}, "ggml_types.lm_head"),
           ({"quant_method": "gguf", "ggml_types": {}}, "ggml_types"),
           ({"quant_method": "gguf", "ggml_types": {"q": "Q4_K"}, "imatrix": 1}, "imatrix")]
    for quant, field in bad:
        with pytest.raises(ConfigError, match=field) as e:
            int_fields(quant)
        assert "\n" not in str(e.value)
    for forms in ("v:8:16", "lm_head:8:16:1", "v:3:16:1", "v:8:15:1"):
        with pytest.raises(ConfigError, match="model.weight_int_forms") as e:
            load_config("tiny", {"model.weight_int_forms": forms})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="weight_int_forms") as e:  # the file's forms, not others
        load_config("tiny", {"model.weight_int_forms": "v:4:32:1"}, model_path=FILES["llama_Q4_K_M"])
    assert "\n" not in str(e.value)
