"""The shipped `tiny` checkpoint (configs/tiny/, trained by configs/tiny/train.py): it has
tiny_random's shapes, loads the same in jaxfill and transformers, matches the training
forward, and makes the engine write English words where random init writes none."""

import dataclasses
import importlib.util
import os
import re
import sys
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxfill.configs
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ModelConfig
from jaxfill.models.families.registry import config_from_hf

CONFIGS = os.path.dirname(jaxfill.configs.__file__)
TINY_DIR = os.path.join(CONFIGS, "tiny")
SNIPPET = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
ENGINE = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
          "engine.num_pages": 64, "engine.max_model_len": 256, "engine.max_num_seqs": 4}
# Common words of English (and of Shakespeare's English); two letters or more, so that
# stray single letters never count.
WORDS = set("""the and of to my you that is not with be in it me he his her your thou thee thy
for what this have will so but as do shall lord all no our him we she are by on good sir know
love now come well here more let say if was there them they then than when where how why who
would should man men king go see hath doth art upon make like us am an at or""".split())


def tiny_model_config() -> ModelConfig:
    with open(os.path.join(CONFIGS, "tiny_random.toml"), "rb") as f:
        return ModelConfig.from_dict(tomllib.load(f)["model"])


def load_script(name: str):
    """configs/tiny/<name>.py as a module (the folder is package data, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tiny_{name}", os.path.join(TINY_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained():
    return load_hf_params(TINY_DIR, tiny_model_config(), progress=False)


def snippet_ids() -> np.ndarray:  # [T] int32: BOS + UTF-8 bytes, as the byte tokenizer encodes
    return np.asarray([256] + list(SNIPPET.encode()), np.int32)


def test_checkpoint_has_tiny_random_shapes_and_fits_in_5mb(trained):
    shapes = lambda m: {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                        if f.name not in ("tokenizer", "seed")}
    assert shapes(config_from_hf(TINY_DIR)) == shapes(tiny_model_config())
    assert os.path.getsize(os.path.join(TINY_DIR, "model.safetensors")) <= 5 * 2**20
    from jaxfill.models.decoder import Decoder

    random_params = nnx.to_flat_state(nnx.split(Decoder(tiny_model_config()))[1])
    trained_params = nnx.to_flat_state(nnx.split(trained)[1])
    for (path, a), (_, b) in zip(random_params, trained_params, strict=True):
        assert a.shape == b.shape, path
        assert not np.allclose(a[...], b[...]), f"{path} still holds its random init"


def test_transformers_loads_it_with_the_same_logits(trained):
    torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
    import transformers

    train = load_script("train")
    hf = transformers.LlamaForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    ids = snippet_ids()
    with torch.no_grad():
        expected = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = train.paged_logits(trained, ids)  # the engine's paged forward, NaN-filled spare pages
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_training_forward_matches_the_paged_forward(trained):
    train = load_script("train")
    ids = snippet_ids()
    params = nnx.to_pure_dict(nnx.split(trained)[1])
    ours = np.asarray(train.train_forward(params, jnp.asarray(ids[None]), trained.config))[0]
    np.testing.assert_allclose(train.paged_logits(trained, ids), ours, atol=1e-4, rtol=0)


def english_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w in WORDS]


def reads_like_english(texts: list[str]) -> bool:
    """Mostly letters, spaces and punctuation, and at least 6 distinct common words."""
    joined = "".join(texts)
    plain = sum(c.isascii() and (c.isalpha() or c in " \n,.;:!?'-") for c in joined)
    return len(joined) > 0 and plain >= 0.9 * len(joined) and len(set(english_words(joined))) >= 6


def generations(preset: str) -> list[str]:
    config = load_config(preset, ENGINE)
    params = [SamplingParams(max_tokens=48),
              SamplingParams(max_tokens=48, temperature=0.7, seed=1),
              SamplingParams(max_tokens=48),
              SamplingParams(max_tokens=48, temperature=0.7, seed=2)]
    with Engine(config, progress=False) as engine:
        done = engine.generate(["ROMEO:\n", "ROMEO:\n", "Hello", "Hello"], params)
    return [c.text for c in done]


@pytest.mark.slow
def test_trained_tiny_writes_english_words_random_init_does_not():
    assert os.path.samefile(load_config("tiny").model_path, TINY_DIR)  # the preset ships these weights
    trained_texts = generations("tiny")
    random_texts = generations("tiny_random")
    assert reads_like_english(trained_texts), trained_texts
    assert not reads_like_english(random_texts), random_texts  # the check has teeth


def test_prepare_data_strips_the_markdown():
    prepare = load_script("prepare_data")
    markdown = ("# Hamlet\n\n## ACT I\n\n_Enter BERNARDO and FRANCISCO, two\nSentinels_\n\n"
                "**BERNARDO**  \nWho's there?  \nNay, answer me.\n\n\n\n"
                "**CORNELIUS & VOLTIMAND**  \n_\\[Aside]_ In that, and all things.\n")
    assert prepare.markdown_to_text(markdown) == (
        "Hamlet\n\nACT I\n\nEnter BERNARDO and FRANCISCO, two\nSentinels\n\n"
        "BERNARDO:\nWho's there?\nNay, answer me.\n\n"
        "CORNELIUS & VOLTIMAND:\n[Aside] In that, and all things.\n")
