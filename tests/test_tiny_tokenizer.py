"""The tiny presets' HF tokenizer files (configs/tiny/tokenizer.json) tokenize exactly like
ByteTokenizer, so the smg gateway and transformers agree with jaxfill on every id."""

import importlib.util
import json
import os

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from jaxfill.engine.config import load_config
from jaxfill.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DIR = os.path.join(ROOT, "configs", "tiny")
HF = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
HF.encode_special_tokens = True  # what tokenizer_config.json's split_special_tokens asks for
BYTES = ByteTokenizer()
# Ids as a model may emit them: bytes (valid UTF-8 or not), BOS/EOS and unused specials.
IDS = st.lists(st.one_of(st.integers(0, 255), st.integers(0, 319)), max_size=40)
# Text that includes the special tokens' own spellings: they stay bytes.
TEXT = st.text(max_size=60) | st.lists(st.sampled_from(["<s>", "</s>", "<reserved_300>", "é", "🦙", " "])).map("".join)


def stream(tok, prompt, output):
    detok = tok.detokenizer(prompt)
    return [detok.feed([i]) for i in output] + [detok.flush()]


def test_committed_files_are_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tokenizer", os.path.join(TINY_DIR, "make_tokenizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(tmp_path / name) as a, open(os.path.join(TINY_DIR, name)) as b:
            assert json.load(a) == json.load(b), name


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_hf_file_encodes_like_bytes(text):
    assert HF.encode(text).ids == BYTES.encode(text)
    assert HF.encode(text, add_special_tokens=False).ids == BYTES.encode(text, add_bos=False)


@settings(max_examples=300, deadline=None)
@given(IDS)
def test_hf_file_decodes_like_bytes(ids):
    assert HF.decode(ids, skip_special_tokens=True) == BYTES.decode(ids)


@settings(max_examples=200, deadline=None)
@given(TEXT, IDS, IDS)
@example("", [194, 256], [128])  # a special between a lead byte and its continuation
def test_tiny_preset_loader_matches_bytes_including_streaming(text, prompt, output):
    tok = load_tokenizer(load_config("tiny").model, TINY_DIR)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == BYTES.vocab_size
    assert tok.encode(text) == BYTES.encode(text)
    assert tok.decode(output) == BYTES.decode(output)
    assert "".join(stream(tok, prompt, output)) == "".join(stream(BYTES, prompt, output))


def test_chat_template_renders_role_lines_then_the_assistant_prompt():
    from jinja2 import Template

    with open(os.path.join(TINY_DIR, "tokenizer_config.json")) as f:
        config = json.load(f)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert text == "system: Be brief.\nuser: Hi\nassistant:"
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert [HF.token_to_id(config["bos_token"]), HF.token_to_id(config["eos_token"])] == [256, 257]
