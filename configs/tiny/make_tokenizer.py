"""Writes tokenizer.json and tokenizer_config.json for the tiny presets: HF files equal to
ByteTokenizer (id b = byte b, <s> = 256, </s> = 257, ids 258..319 unused specials), so
HF-based tools (the smg gateway, transformers) tokenize exactly as jaxfill does.

Run from anywhere: `python configs/tiny/make_tokenizer.py [OUT_DIR]` (default: this folder).
tests/test_tiny_tokenizer.py checks the committed files equal what this writes.
"""

from __future__ import annotations

import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS, VOCAB_SIZE = "<s>", "</s>", 320
# "user: hi\nassistant: hello\n" ... then "assistant:" for the reply. No BOS in the text:
# the tokenizer's post-processor adds it when asked to add special tokens.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def build_tokenizer() -> Tokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    char_of_byte = _bytes_to_unicode()
    assert sorted(byte_chars) == sorted(char_of_byte.values())
    vocab = {char_of_byte[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS] + [f"<reserved_{i}>" for i in range(258, VOCAB_SIZE)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, 256)])
    assert tok.token_to_id(BOS) == 256 and tok.token_to_id(EOS) == 257
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
            # "<s>" typed in a prompt stays three bytes, as in ByteTokenizer (tokenizer.json
            # cannot say this; transformers and jaxfill's HFTokenizer read it from here).
            "split_special_tokens": True}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write(out_dir: str) -> None:
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
