"""Tokenizers: HF `tokenizers` for real checkpoints, bytes for the tiny preset, and
incremental detokenizers that never emit half a UTF-8 character.

A detokenizer is primed with the prompt ids, so the text it streams is exactly what the
output adds to the prompt's text: the concatenated pieces equal
`decode(prompt + output)` minus its longest common prefix with `decode(prompt)`
(tests/test_detokenizer_priming.py). Usually that is `decode(prompt)` itself; when the
prompt ends in a broken character that the output completes, the completed character is
streamed. Without the prompt, SentencePiece/Metaspace decoders drop the first output
token's leading space. One known exception: Llama 2's ByteFallback decoder turns a whole
run of byte tokens into U+FFFDs when the run is invalid UTF-8, rewriting text already
streamed; no streaming detokenizer can follow that.
"""

from __future__ import annotations

import codecs
import os

from jaxfill.engine.request import InvalidRequest

# Prompt tokens a detokenizer keeps as decoding context: enough to hold a character split
# over up to 4 byte tokens plus the token before it.
PROMPT_CONTEXT = 8


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

    def detokenizer(self, prompt_ids=()) -> "ByteDetokenizer":
        return ByteDetokenizer(self, prompt_ids)


class ByteDetokenizer:
    def __init__(self, tokenizer: ByteTokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The prompt's text is not ours to emit, but a character it leaves unfinished is
        # once the output completes it; if the output does not, decode(prompt) already
        # showed it as U+FFFD.
        self.decoder.decode(tokenizer.decode_bytes(list(prompt_ids)[-PROMPT_CONTEXT:]))
        self.prompt_tail = self.decoder.getstate()[0].decode("utf-8", errors="replace")

    def _emit(self, text: str) -> str:
        if text and self.prompt_tail:
            text, self.prompt_tail = text[_common_prefix_len(self.prompt_tail, text):], ""
        return text

    def feed(self, ids) -> str:
        return self._emit(self.decoder.decode(self.tokenizer.decode_bytes(ids)))

    def flush(self) -> str:
        return self._emit(self.decoder.decode(b"", final=True))


class HFTokenizer:
    """A `tokenizer.json` from a Hugging Face model directory, or a `tokenizers.Tokenizer`
    built otherwise (a GGUF's, engine/gguf_tokenizer.py) with its chat template."""

    def __init__(self, path, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None,
                 chat_template: str | None = None, special_text: dict | None = None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path) if isinstance(path, str) else path
        # transformers' `split_special_tokens`: "<s>" typed in a prompt stays text.
        config = _tokenizer_config(path) if isinstance(path, str) else {}
        self.tok.encode_special_tokens = config.get("split_special_tokens", False)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template or config.get("chat_template")
        self.special_text = dict(special_text or {})  # {"bos_token": "<s>", ...}: the template's variables

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, as transformers' apply_chat_template(tokenize=False)."""
        from jaxfill.engine.gguf_tokenizer import render_chat

        if not self.chat_template:
            raise InvalidRequest("messages", "this model's tokenizer has no chat template")
        return render_chat(self.chat_template, messages, add_generation_prompt, **self.special_text)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self, prompt_ids=()) -> "HFDetokenizer":
        return HFDetokenizer(self, prompt_ids)


class HFDetokenizer:
    """Decodes a growing id list, holding text back while it ends in a broken character.

    Each step decodes a window that starts at the previous emission point (first, at a
    character boundary a few prompt tokens back) and emits what the new ids added to the
    window's text: a decoder that strips the first token's leading space (Metaspace)
    strips it from both sides of that difference, so later tokens keep theirs.
    """

    def __init__(self, tokenizer: HFTokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        ids = [int(i) for i in list(prompt_ids)[-PROMPT_CONTEXT:]]
        start, end = self._clean_span(ids)
        self.ids = ids[start:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.next_prefix_offset = end - start  # where the window starts after the next emission

    def _clean_span(self, ids) -> tuple[int, int]:
        """The latest-ending ids[i:j] that decodes without U+FFFD, so the window starts and,
        after the first emission, restarts on character boundaries. (Byte fallback decodes
        a run of byte tokens as a whole: a window cut inside a character would turn the
        whole run into U+FFFDs.)"""
        for j in range(len(ids), 0, -1):
            for i in range(j):
                text = self.tokenizer.decode(ids[i:j])
                # Empty text (special tokens only) proves no boundary: bytes either side of
                # a skipped special still join into one character.
                if text and "\ufffd" not in text:
                    return i, j
        return 0, 0

    def _new_text(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        # Not len(prefix): a prompt ending in a broken character decodes it as U+FFFD,
        # which the output may turn into a real character.
        return text[_common_prefix_len(prefix, text):]

    def feed(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        emitted = self._new_text()
        if not emitted or emitted.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.next_prefix_offset, len(self.ids)
        self.next_prefix_offset = self.read_offset
        return emitted

    def flush(self) -> str:
        emitted = self._new_text()
        self.prefix_offset = self.read_offset = self.next_prefix_offset = len(self.ids)
        return emitted


class IdsOnlyTokenizer:
    """Stands in when a checkpoint has no tokenizer.json: token-id prompts only, no text."""

    def __init__(self, reason: str):
        self.reason = reason
        self.vocab_size = None

    def encode(self, text, add_bos=True):
        raise InvalidRequest("prompt", f"text prompts need a tokenizer ({self.reason}); pass token ids")

    def decode(self, ids):
        return ""

    def detokenizer(self, prompt_ids=()):
        return self

    def feed(self, ids):
        return ""

    def flush(self):
        return ""


def _tokenizer_config(tokenizer_json: str) -> dict:
    """The tokenizer_config.json beside a tokenizer.json, or {}."""
    import json

    path = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def load_tokenizer(model_config, model_path: str | None = None):
    """HF tokenizer when the model directory has tokenizer.json (or is a GGUF whose
    vocabulary engine/gguf_tokenizer.py builds), else bytes."""
    from jaxfill.models.gguf import gguf_file, header

    gguf = gguf_file(model_path)
    if gguf:
        from jaxfill.engine.gguf_tokenizer import UnsupportedVocabulary, gguf_tokenizer

        try:
            tok, template, special = gguf_tokenizer(header(gguf).metadata)
        except UnsupportedVocabulary as e:
            return IdsOnlyTokenizer(f"{os.path.basename(gguf)}: {e}")
        return HFTokenizer(tok, eos_token_ids=model_config.eos_token_id, bos_token_id=model_config.bos_token_id,
                           chat_template=template, special_text=special)
    if model_path and os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return HFTokenizer(os.path.join(model_path, "tokenizer.json"),
                           eos_token_ids=model_config.eos_token_id, bos_token_id=model_config.bos_token_id)
    if model_config.tokenizer == "hf":
        raise ValueError("this config needs a tokenizer.json: pass --model DIR holding one, "
                         "or use --prompt-ids")
    return ByteTokenizer(model_config.vocab_size, model_config.bos_token_id, model_config.eos_token_id or (257,))
