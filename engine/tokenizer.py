"""Tokenizers: HF `tokenizers` for real checkpoints, bytes for the tiny preset, and an
incremental detokenizer that never emits half a UTF-8 character."""

from __future__ import annotations

import codecs
import os


class ByteTokenizer:
    """Token i < 256 is byte i; 256 = BOS, 257 = EOS; ids up to vocab_size are unused specials."""

    def __init__(self, vocab_size: int = 320, bos_token_id: int | None = 256,
                 eos_token_ids: tuple[int, ...] = (257,)):
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode_bytes(self, ids) -> bytes:
        return bytes(i for i in ids if 0 <= i < 256)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> "ByteDetokenizer":
        return ByteDetokenizer(self)


class ByteDetokenizer:
    def __init__(self, tokenizer: ByteTokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids) -> str:
        return self.decoder.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


class HFTokenizer:
    """A `tokenizer.json` from a Hugging Face model directory."""

    def __init__(self, path: str, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> "HFDetokenizer":
        return HFDetokenizer(self)


class HFDetokenizer:
    """Decodes a growing id list, holding text back while it ends in a broken character.

    Decoding a window that starts a few tokens back keeps tokenizers that merge spaces
    across tokens (SentencePiece's leading space) from dropping or doubling characters.
    """

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def feed(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        emitted = text[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return emitted

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]


def load_tokenizer(model_config, model_path: str | None = None):
    """HF tokenizer when the model directory has tokenizer.json, else bytes."""
    if model_path and os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return HFTokenizer(os.path.join(model_path, "tokenizer.json"),
                           eos_token_ids=model_config.eos_token_id, bos_token_id=model_config.bos_token_id)
    if model_config.tokenizer == "hf":
        raise ValueError("this config needs a tokenizer.json: pass --model DIR holding one, "
                         "or use --prompt-ids")
    return ByteTokenizer(model_config.vocab_size, model_config.bos_token_id, model_config.eos_token_id or (257,))
