"""GGUF checkpoints (models/gguf/): our dequantizers against the reference ones (gguf's,
which transformers uses), and tiny Llama / Qwen2 / Qwen3 GGUFs (tests/gguf_files.py: every
supported tensor type among them, Llama's q/k rows permuted as llama.cpp stores them)
loaded by us and by transformers' `from_pretrained(..., gguf_file=)`: f32 last-row logits
within 1e-5 relative, greedy tokens equal."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
from gguf_files import gguf, random_blocks, write_gguf
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.gguf import gguf_file, header, quants, tensors
from jaxfill.models.gguf.tensors import GGUFTensor
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scale bits include inf and NaN
@pytest.mark.parametrize("kind", sorted(quants.NAMES))
def test_dequantizer_equals_the_reference_on_random_blocks(kind):
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[kind]
    rows, values = 5, 1024
    if kind in ("F32", "F16", "BF16"):  # plain floats: the reference's own encoding of random values
        floats = rng.standard_normal((rows, values)).astype(np.float32)
        data = floats.view(np.uint8) if kind == "F32" else gguf.quants.quantize(floats, qtype)
    else:
        data = random_blocks(rng, kind, rows, values)
        data[:, :2] = rng.integers(0, 256, (rows, 2))  # any scale bits, not only small ones
    data = data.reshape(rows, -1).view(np.uint8)
    ours = quants.dequantize_rows(data, quants.NAMES[kind], values)
    ref = gguf.quants.dequantize(data, qtype)
    assert ours.shape == ref.shape == (rows, values)
    np.testing.assert_array_equal(ours, ref)


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: str(root / arch) for arch in ("llama", "qwen2", "qwen3")
            if write_gguf(str(root / arch), arch)}


def load_hf_gguf(directory: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(directory, gguf_file="model.gguf", dtype=torch.float32,
                                                   attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ("llama", "qwen2", "qwen3"))
def test_gguf_logits_and_greedy_tokens_match_transformers_gguf_load(gguf_dirs, arch):
    path = os.path.join(gguf_dirs[arch], "model.gguf")
    assert gguf_file(gguf_dirs[arch]) == path  # a directory holding one GGUF names it
    config = config_from_hf(path).replace(dtype="float32")
    model = load_hf_params(gguf_dirs[arch], config, progress=False)
    hf = load_hf_gguf(gguf_dirs[arch])
    for length, tokens in prompts(config.vocab_size)[:3]:
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (arch, length, err)
    check_greedy_matches_hf(model, config, hf, 16)


def test_llama_q_and_k_rows_are_unpermuted(gguf_dirs):
    """Reading a Llama's q rows without the un-permutation moves the logits (the parity
    test above would catch a missing one only through them)."""
    path = os.path.join(gguf_dirs["llama"], "model.gguf")
    info = header(path).tensors["blk.0.attn_q.weight"]
    plain = GGUFTensor(path, info).read_rows(0, info.shape[0])
    unpermuted = dict(tensors(path))["model.layers.0.self_attn.q_proj.weight"].read_rows(0, info.shape[0])
    half = info.shape[0] // 4 // 2  # 4 heads
    np.testing.assert_array_equal(unpermuted[:half], plain[0:2 * half:2])  # head 0's first half: even rows
    assert not np.array_equal(unpermuted, plain)


def test_row_boxes_read_what_the_whole_tensor_holds(gguf_dirs):
    """A box of rows (as a sharded placement reads) equals that box of the whole tensor,
    through the un-permutation and a transposed param view."""
    path = os.path.join(gguf_dirs["llama"], "model.gguf")
    k = dict(tensors(path))["model.layers.1.self_attn.k_proj.weight"]
    rows, cols = k.shape
    view = k.slices((rows, cols), (1, 0), np.float32)  # [in, out], as a param is stored
    whole = view.read()
    np.testing.assert_array_equal(view.read((slice(10, 70), slice(33, 101))), whole[10:70, 33:101])
    np.testing.assert_array_equal(k.take_rows((32, 96)).read_rows(0, 64), whole.T[32:96])


def test_unsupported_gguf_is_refused_by_name(tmp_path):
    write_gguf(str(tmp_path), "llama", **{"llama.expert_count": 4})
    with pytest.raises(ConfigError, match="llama.expert_count"):
        config_from_hf(str(tmp_path / "model.gguf"))
