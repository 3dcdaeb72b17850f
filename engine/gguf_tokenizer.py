"""The tokenizer a GGUF's metadata describes, built as transformers builds it from the same
file (`AutoTokenizer.from_pretrained(dir, gguf_file=)`), and its chat template.

A GGUF has no tokenizer.json: it stores the vocabulary, the merges, each token's type and
the special ids under `tokenizer.ggml.*`. The byte-level BPE vocabularies (`model = "gpt2"`:
Llama 3, Qwen, SmolLM) are built here; the pre-tokenizer's split is picked by
`tokenizer.ggml.pre`, as llama.cpp and transformers pick it. Any other vocabulary (a
SentencePiece `llama`) leaves the model on token-id prompts, saying why.
"""

from __future__ import annotations

# The splits of the byte-level vocabularies transformers knows by `tokenizer.ggml.pre`;
# any other name splits as GPT-2 does (the ByteLevel pre-tokenizer's own regex).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), LLAMA3_SPLIT),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), QWEN2_SPLIT)}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


class UnsupportedVocabulary(ValueError):
    """A GGUF vocabulary this module does not build (the reason is the message)."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def gguf_tokenizer(metadata: dict):
    """(tokenizers.Tokenizer, chat template or None, {"bos_token": str, "eos_token": str})."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2" or "tokenizer.ggml.merges" not in metadata:
        raise UnsupportedVocabulary(f"tokenizer.ggml.model {kind!r} (only byte-level BPE, 'gpt2', is built)")
    tokens = metadata["tokenizer.ggml.tokens"]
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # a token outside the byte alphabet is raw text: spell its UTF-8 bytes in the alphabet
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split = SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or ()
    # control tokens whole and special (a "control" token outside the alphabet is a mislabel)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
                            if kind == CONTROL and set(t) <= spelled])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                    if kind == USER_DEFINED and t in vocab])
    names = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        index = metadata.get(f"tokenizer.ggml.{key}")
        names[name] = tokens[index] if index is not None and 0 <= index < len(tokens) else None
    if metadata.get("tokenizer.ggml.add_bos_token") and names["bos_token"] is not None:
        bos = (names["bos_token"], metadata["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                           special_tokens=[bos])
    return tok, metadata.get("tokenizer.chat_template"), names


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **special) -> str:
    """A chat template rendered as transformers renders it: a sandboxed jinja2 with
    trim_blocks and lstrip_blocks, the special tokens' text as variables."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
